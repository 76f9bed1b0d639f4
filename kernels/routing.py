"""Routing: the router's softmax + top-k (Qwen3 semantics) and generators of test routings.

Every generator returns ``(topk_ids [T, K] int32, topk_weights [T, K] float32)`` on NumPy, deterministic
by seed. The ids come from the generator's rule; the weights are a softmax over random logits of the
chosen slots (renormalised to sum to 1, as ``norm_topk_prob`` models do).
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from kernels.contract import check_int

# hot-expert skew of each Zipf generator, p(rank r) ~ 1 / r**s over a random order of the experts: "zipf" (1.2) is
# what the 2026-12-01 bench runs used; "zipf-1" is the exponent the serving comparison quotes; "zipf-2" is heavier
ZIPF_EXPONENTS = {"zipf": 1.2, "zipf-1": 1.0, "zipf-2": 2.0}
ZIPF_EXPONENT = ZIPF_EXPONENTS["zipf"]
CORRELATED_KEEP = 0.75  # "correlated": the chance each slot keeps the batch's shared expert
GENERATORS = ("uniform", *ZIPF_EXPONENTS, "correlated", "same")
ROUTINGS = (*GENERATORS, "fixed")


def route(logits: np.ndarray, top_k: int, renormalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (topk_ids [T, K] int32, topk_weights [T, K] float32).

    Softmax over all experts in float32, take the ``top_k`` largest (ties to the lower expert id),
    and with ``renormalize`` divide the chosen probabilities by their sum (Qwen3's ``norm_topk_prob``).
    The max-shift runs in the logits' own precision (float64 stays float64, ints become float64, narrower
    floats float32) before the float32 softmax, so any finite logits give finite weights: the shifted values
    are <= 0, and one that overflows float32 becomes -inf, whose exp is 0. float32 logits: all float32.
    """
    logits = np.asarray(logits)
    work = _shift_dtype(logits.dtype)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E], got shape {logits.shape}")
    tokens, experts = (int(d) for d in logits.shape)
    if tokens < 1:
        raise ValueError(f"logits needs at least one token (T >= 1), got shape {logits.shape}")
    if experts < 1:
        raise ValueError(f"logits needs at least one expert (E >= 1), got shape {logits.shape}")
    top_k = check_int("top_k", top_k, 1)
    if top_k > experts:
        raise ValueError(f"top_k must be an int in [1, E={experts}], got {top_k}")
    if not np.all(np.isfinite(logits)):
        raise ValueError("logits must be finite, found NaN or inf")
    with np.errstate(over="ignore"):  # a shift past float32's range is -inf: exp gives 0, as it should
        logits = logits.astype(work)
        shifted = (logits - logits.max(axis=1, keepdims=True)).astype(np.float32, copy=False)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    topk_ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    topk_weights = np.take_along_axis(probs, topk_ids, axis=1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(axis=1, keepdims=True)
    return topk_ids.astype(np.int32), topk_weights.astype(np.float32)


def _shift_dtype(dtype: np.dtype) -> np.dtype:
    """The precision ``route`` max-shifts logits of ``dtype`` in; TypeError for a non-numeric dtype."""
    if dtype.kind in "iu":
        return np.dtype(np.float64)
    if dtype.kind == "f":
        return dtype if dtype.itemsize >= 8 else np.dtype(np.float32)
    if dtype.kind == "V" and dtype.names is None:
        try:  # ml_dtypes' floats (bfloat16, fp8): exact in float32
            ml_dtypes.finfo(dtype)
            return np.dtype(np.float32)
        except Exception:  # noqa: BLE001 - some other opaque type
            pass
    raise TypeError(f"logits must hold real numbers (float or int), got dtype {dtype}")


def _slot_weights(rng: np.random.Generator, tokens: int, top_k: int) -> np.ndarray:
    logits = rng.standard_normal((tokens, top_k)).astype(np.float32)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def make_routing(
    tokens: int,
    experts: int,
    top_k: int,
    routing: str | Sequence[int] | Sequence[Sequence[int]] | np.ndarray = "uniform",
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate a routing for ``tokens`` tokens over ``experts`` experts, ``top_k`` slots each.

    routing:
      "uniform"  each token picks ``top_k`` distinct experts uniformly at random (the bench's default);
      "zipf"     distinct experts drawn with hot experts favoured, p(rank r) ~ 1/r**1.2, ranks shuffled
                 ("zipf-1": exponent 1, "zipf-2": exponent 2, heavier);
      "correlated" the batch shares one set of ``top_k`` experts: each slot keeps its shared expert with
                 probability 3/4, else takes a uniformly random expert outside the set (tokens of one request);
      "same"     every token on the same ``top_k`` experts (all on one expert set);
      "fixed"    not a string: a list of ``top_k`` ids for every token, or a [T, K] array of ids
                 (duplicates allowed: their contributions add).
    """
    tokens = check_int("tokens", tokens, 1)
    experts = check_int("experts", experts, 1)
    top_k = check_int("top_k", top_k, 1)
    seed = check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)
    if isinstance(routing, str):
        if routing in GENERATORS and top_k > experts:
            raise ValueError(
                f"routing {routing!r} picks distinct experts: top_k ({top_k}) must be <= experts ({experts})"
            )
        if routing == "uniform":
            # top-k of i.i.d. keys is a uniformly random k-subset
            topk_ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        elif routing in ZIPF_EXPONENTS:
            popularity = 1.0 / np.arange(1, experts + 1) ** ZIPF_EXPONENTS[routing]
            log_p = np.log(popularity[rng.permutation(experts)])
            # Gumbel-top-k: distinct draws without replacement, proportional to popularity
            keys = log_p[None, :] + rng.gumbel(size=(tokens, experts))
            topk_ids = np.argsort(-keys, axis=1)[:, :top_k]
        elif routing == "correlated":
            shared = rng.choice(experts, size=top_k, replace=False)
            keep = rng.random((tokens, top_k)) < CORRELATED_KEEP
            keys = rng.random((tokens, experts))  # the replacements: uniform over the experts outside the set
            keys[:, shared] = np.where(keep, 2.0, -1.0)  # kept shared experts first; dropped ones never return
            topk_ids = np.argsort(-keys, axis=1, kind="stable")[:, :top_k]
        elif routing == "same":
            chosen = rng.choice(experts, size=top_k, replace=False)
            topk_ids = np.broadcast_to(chosen, (tokens, top_k))
        else:
            raise ValueError(f"routing must be one of {GENERATORS} or a list of expert ids, got {routing!r}")
    else:
        ids = np.asarray(routing)
        if ids.ndim == 1:
            ids = np.broadcast_to(ids, (tokens, ids.shape[0]))
        if ids.shape != (tokens, top_k):
            raise ValueError(
                f"a fixed routing must be {top_k} ids or a [T, K] = [{tokens}, {top_k}] array, got {ids.shape}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"a fixed routing must hold integer expert ids, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= experts:
            raise ValueError(f"a fixed routing's ids must lie in [0, {experts}), got [{ids.min()}, {ids.max()}]")
        topk_ids = ids
    return np.ascontiguousarray(topk_ids, dtype=np.int32), _slot_weights(rng, tokens, top_k)


def unique_experts(topk_ids: np.ndarray) -> int:
    """How many distinct experts a routing touches (what the weight-bytes accounting counts)."""
    return int(np.unique(np.asarray(topk_ids)).size)
