"""The PyTorch-composed decode step: the framework baseline a user would otherwise run (peers extra; torch imported
lazily, so this module imports anywhere and :data:`WHY_NOT` says why it cannot run).

The same model as :mod:`kernels.decode.step` (the :class:`~kernels.decode.step.DeviceModel`'s weights viewed as
torch tensors, zero-copy) composed from framework ops: ``F.embedding``; per layer ``F.rms_norm`` -> ``F.linear``
(cuBLAS) for QKV -> per-head q/k ``F.rms_norm`` -> RoPE from the same float32 cos/sin tables (fp32, rounded once)
-> the KV append by indexed assignment into the preallocated cache [S, kv_heads, capacity, D] at each slot's length
-> ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over the valid positions (equal lengths: the first
n + 1 positions, no mask; different lengths: a padded window with a boolean mask built on the device from
``lengths``) -> ``F.linear`` O + residual -> ``F.rms_norm`` -> router ``F.linear`` + softmax + ``torch.topk`` +
renormalize -> the MoE by the lab's Triton peer (:mod:`tools.peers.triton_fused_moe`: vLLM's fused-MoE design; the
W8A8 form on fp8-block128 weights) or, without Triton, :func:`torch_moe` (gather + bmm, no loop) -> residual; final
``F.rms_norm``, ``F.linear`` LM head, argmax; ``lengths += 1``. The whole step is captured in one
``torch.cuda.CUDAGraph`` and timed with CUDA events.

fp8-block128: the dense q/k/v/o projections are dequantized to bf16 once at build (cuBLAS bf16 GEMMs; a framework
FP8 GEMM is not composed here), the experts run the W8A8 peer on the FP8 weights.

In a captured graph at equal lengths the attention's window is the capture's n + 1 positions (a graph holds fixed
shapes); the timing resets ``lengths`` before each sample, so replays append within ``inner`` positions of it.
"""

from __future__ import annotations

from typing import Any


def _why_not() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"the PyTorch-composed step needs PyTorch (pip install '.[peers]'): {exc}"
    if not torch.cuda.is_available():
        return "the PyTorch-composed step needs a CUDA GPU that PyTorch can use; it sees none"
    return None


WHY_NOT = _why_not()


def as_torch(arr: Any) -> Any:
    """A zero-copy torch view of a CuPy array (DLPack with stream -1: no stream handshake, capture-safe); bf16
    through a 16-bit integer view."""
    import numpy as np
    import torch
    import torch.utils.dlpack

    from kernels.arrays import BF16

    bf16 = arr.dtype == BF16
    tensor = torch.utils.dlpack.from_dlpack((arr.view(np.int16) if bf16 else arr).__dlpack__(stream=-1))
    return tensor.view(torch.bfloat16) if bf16 else tensor


def _dense(w: Any) -> Any:
    """A dense matrix as a bf16 tensor: bf16 viewed, fp8-block128 dequantized once (float32 product, rounded)."""
    from kernels.formats import Quantized, dequantize_blocks

    if isinstance(w, Quantized):
        return as_torch(dequantize_blocks(w.values, w.scales)).bfloat16().contiguous()
    return as_torch(w)


def torch_moe(x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> None:
    """The MoE without the peer, loop-free: each (token, slot)'s expert matrices gathered, batched GEMVs (bmm), SiLU
    times up, the routing weights and the slot sum in fp32, one bf16 rounding into ``out``."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()
    xs = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T*K, H, 1]
    gate_up = torch.bmm(w13[flat], xs).squeeze(-1)  # [T*K, 2I]
    inter = gate_up.shape[-1] // 2
    act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).bfloat16().unsqueeze(-1)
    down = torch.bmm(w2[flat], act).squeeze(-1).float().view(tokens, top_k, -1)  # [T, K, H]
    out.copy_((down * weights.float().unsqueeze(-1)).sum(dim=1).bfloat16())


class TorchStep:
    """The composed step on fixed buffers (:meth:`build`); :meth:`step` runs it eagerly, :meth:`time` captures it in
    one CUDA graph and times replays."""

    def __init__(self, device_model: Any, device_state: Any, tokens: int, use_peer: bool = True) -> None:
        import numpy as np
        import torch

        from kernels.contract import Dims
        from kernels.decode.step import rope_tables

        shape = device_model.config
        self.shape, self.T = shape, int(tokens)
        self.eps = float(shape.rms_norm_eps)
        self.embed, self.final_norm, self.lm_head = (as_torch(a) for a in (device_model.embed, device_model.final_norm,
                                                                          device_model.lm_head))
        self.layers = []
        for index in device_model.order:
            w = device_model.layers[index]
            self.layers.append({"input_norm": as_torch(w.input_norm), "wqkv": _dense(w.wqkv),
                                "q_norm": as_torch(w.q_norm), "k_norm": as_torch(w.k_norm), "wo": _dense(w.wo),
                                "post_norm": as_torch(w.post_norm), "router": as_torch(w.router),
                                "w13": w.w13, "w2": w.w2})
        self.k_cache = [as_torch(k) for k in device_state.k_cache]
        self.v_cache = [as_torch(v) for v in device_state.v_cache]
        self.lengths = as_torch(device_state.lengths)
        self.host_lengths = [int(n) for n in device_state.lengths.get()]
        cos, sin = rope_tables(int(device_state.capacity), shape.head_dim, shape.rope_theta)
        self.cos = torch.from_numpy(np.asarray(cos, np.float32)).cuda()
        self.sin = torch.from_numpy(np.asarray(sin, np.float32)).cuda()
        self.tokens = torch.zeros(self.T, dtype=torch.int64, device="cuda")
        self.moe_out = torch.empty(self.T, shape.hidden, dtype=torch.bfloat16, device="cuda")
        self.hidden = torch.empty(self.T, shape.hidden, dtype=torch.bfloat16, device="cuda")
        self.slots = torch.arange(self.T, device="cuda")
        self.fp8 = device_model.weight_format != "bf16"
        dims = Dims(self.T, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        self.peer = None
        if use_peer:
            try:
                from kernels.dispatch import current_gpu
                from tools import peers
                from tools.peers.triton_fused_moe import FusedMoE

                name = peers.PEER_W8A8 if self.fp8 else peers.PEER
                config = peers.configs(name)[peers.tuned_config(dims, current_gpu(), name)]
                self.peer = FusedMoE(dims, config, w8a8=self.fp8)
            except ImportError:
                self.peer = None
        if self.peer is None and self.fp8:
            raise ValueError("fp8-block128 experts need the W8A8 Triton peer (Triton is not installed)")
        for layer in self.layers:
            if self.fp8:
                layer["w13"] = (as_torch(layer["w13"].values), as_torch(layer["w13"].scales))
                layer["w2"] = (as_torch(layer["w2"].values), as_torch(layer["w2"].scales))
            else:
                layer["w13"], layer["w2"] = as_torch(layer["w13"]), as_torch(layer["w2"])
        self.graph = None

    @classmethod
    def build(cls, device_model: Any, tokens: int, context: int, capacity: int, seed: int = 0) -> TorchStep:
        """A step of ``tokens`` sequences of ``context`` positions (random caches, random input tokens)."""
        import numpy as np
        import torch

        from kernels.decode.step import DeviceState

        state = DeviceState.random(device_model, [context] * tokens, capacity, seed)
        step = cls(device_model, state, tokens)
        step._state = state  # keeps the caches' memory alive
        step.set_tokens(np.random.default_rng(seed).integers(0, device_model.config.vocab_size, size=tokens))
        torch.cuda.synchronize()
        return step

    def set_tokens(self, tokens: Any) -> None:
        import torch

        self.tokens.copy_(torch.as_tensor(list(tokens), dtype=torch.int64))

    # -- the composed step --------------------------------------------------------------------------------------------
    def _attention(self, q: Any, layer: int, window: int | None) -> Any:
        import torch
        import torch.nn.functional as F  # noqa: N812

        k, v = self.k_cache[layer], self.v_cache[layer]
        q = q.unsqueeze(2)  # [T, heads, 1, D]
        if window is None:  # equal lengths: the first n + 1 positions, no mask
            n = self.host_lengths[0] + 1
            out = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)
        else:
            mask = (torch.arange(window, device=q.device)[None, :] <= self.lengths[:, None].long())
            out = F.scaled_dot_product_attention(q, k[:, :, :window], v[:, :, :window],
                                                 attn_mask=mask[:, None, None, :], enable_gqa=True)
        return out.reshape(self.T, -1)

    def _rope(self, x: Any, positions: Any) -> Any:
        import torch

        half = x.shape[-1] // 2
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        first, second = x[..., :half], x[..., half:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).bfloat16()

    def _moe(self, x: Any, layer: dict[str, Any], ids: Any, weights: Any) -> None:
        if self.peer is not None:
            for _, stage in self.peer.stages(x, layer["w13"], layer["w2"], ids, weights, self.moe_out):
                stage()
        else:
            torch_moe(x, layer["w13"], layer["w2"], ids, weights, self.moe_out)

    def step(self) -> None:
        """One decode step on the buffers (eager; what the graph captures)."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        s = self.shape
        heads, kv_heads, D, H, eps = s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.hidden, self.eps  # noqa: N806
        equal = len(set(self.host_lengths)) == 1
        window = None if equal else max(self.host_lengths) + 1
        positions = self.lengths.long()
        h = F.embedding(self.tokens, self.embed)
        for index, layer in enumerate(self.layers):
            qkv = F.linear(F.rms_norm(h, (H,), layer["input_norm"], eps), layer["wqkv"])
            q = qkv[:, : heads * D].view(self.T, heads, D).float()
            k = qkv[:, heads * D : (heads + kv_heads) * D].view(self.T, kv_heads, D).float()
            v = qkv[:, (heads + kv_heads) * D :].view(self.T, kv_heads, D)
            q = self._rope(F.rms_norm(q, (D,), layer["q_norm"].float(), eps), positions)
            k = self._rope(F.rms_norm(k, (D,), layer["k_norm"].float(), eps), positions)
            self.k_cache[index][self.slots, :, positions] = k
            self.v_cache[index][self.slots, :, positions] = v
            h = h + F.linear(self._attention(q, index, window), layer["wo"])
            m = F.rms_norm(h, (H,), layer["post_norm"], eps)
            probs = torch.softmax(F.linear(m, layer["router"]).float(), dim=-1)
            weights, ids = torch.topk(probs, s.top_k, dim=-1)
            if s.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            self._moe(m.contiguous(), layer, ids.int().contiguous(), weights.float().contiguous())
            h = h + self.moe_out
        self.hidden.copy_(F.rms_norm(h, (H,), self.final_norm, eps))
        self.tokens.copy_(torch.argmax(F.linear(self.hidden, self.lm_head).float(), dim=-1))
        self.lengths.add_(1)

    def eager_step(self) -> tuple[Any, Any]:
        """One eager step, the host's lengths advanced: (next tokens [T] int64, hidden [T, H] bf16 as NumPy bf16)."""
        import numpy as np
        import torch

        from kernels.arrays import BF16

        self.step()
        self.host_lengths = [n + 1 for n in self.host_lengths]
        hidden = self.hidden.view(torch.int16).cpu().numpy().view(BF16)
        return self.tokens.cpu().numpy().astype(np.int64), hidden

    def time(self, repeats: int, inner: int) -> list[float]:
        """µs per step: captured as one CUDA graph (warm-up on a side stream first, as torch's graph docs ask),
        ``repeats`` samples of ``inner`` replays between CUDA events, ``lengths`` reset before each sample."""
        import torch

        start_lengths = self.lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
                self.lengths.copy_(start_lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph
        self.lengths.copy_(start_lengths)
        graph.replay()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(repeats):
            self.lengths.copy_(start_lengths)
            start.record()
            for _ in range(inner):
                graph.replay()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) * 1e3 / inner)
        return samples
