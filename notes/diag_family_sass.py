import sys; sys.path.insert(0,'/work/main')
from concurrent.futures import ProcessPoolExecutor
import kernels.warp_decode_batched as W
from kernels.batched.mma import MMA, grouped_knobs
from kernels.batched.pairs import PAIRS
from kernels.batched.fma import FMA, FP8_KNOBS
from kernels.formats import get_format
from kernels.contract import Dims
from kernels.compile import offline_compile
from tools.sass_hashes import text_sections
MAP = [  # (name, old knobs, new family maker, fmt, new knobs)
 ("mma", W.MMA_KNOBS, MMA, "bf16", {}), ("grouped", W.GROUPED_KNOBS, MMA, "bf16", "G"), ("pairs", W.PER_PAIR_KNOBS, PAIRS, "bf16", {}),
 ("mma-fp8", W.MMA_FP8_KNOBS, MMA, "fp8-block128", {}), ("grouped-fp8", W.FP8_GROUPED_KNOBS, MMA, "fp8-block128", "G"), ("pairs-fp8", W.FP8_PER_PAIR_KNOBS, PAIRS, "fp8-block128", {}),
 ("mma-t16", W.MMA_T16_KNOBS, MMA, "bf16-t16", {}), ("grouped-t16", W.GROUPED_T16_KNOBS, MMA, "bf16-t16", "G"), ("pairs-t16", W.PER_PAIR_T16_KNOBS, PAIRS, "bf16-t16", {}),
 ("mma-fp8-t16", W.MMA_FP8_T16_KNOBS, MMA, "fp8-block128-t16", {}), ("grouped-fp8-t16", W.FP8_T16_GROUPED_KNOBS, MMA, "fp8-block128-t16", "G"), ("pairs-fp8-t16", W.FP8_T16_PER_PAIR_KNOBS, PAIRS, "fp8-block128-t16", {}),
 ("batched", {}, FMA, "bf16", {}), ("batched-fp8", W.FP8_KNOBS, FMA, "fp8-block128", FP8_KNOBS),
]
def comp(t): return text_sections(offline_compile(t)[0])
def main(names, Ts, models):
    from kernels.shapes import PRESETS
    jobs=[]
    for name, ok, fam, fmt, nk in MAP:
        if names and name not in names: continue
        for m in models:
            s=PRESETS[m]
            for t in Ts:
                d=Dims(t,s.hidden,s.intermediate,s.experts,s.top_k)
                po=W.FAMILY.resolve(d, **ok); old=W.FAMILY.source.render(**po); onames=W.kernel_names(po)
                f=fam(fmt); knobs=grouped_knobs(get_format(fmt)) if nk=="G" else nk
                pn=f.resolve(d, **knobs); new=f.source.render(**pn)
                nnames=f.kernel_names(pn) if f.kernel_names else f.source.compiled_kernels(**pn)
                jobs.append((name,m,t,old,new,onames,nnames))
    texts=sorted({j[3] for j in jobs}|{j[4] for j in jobs})
    with ProcessPoolExecutor(2) as pool: res=dict(zip(texts, pool.map(comp, texts)))
    bad=0
    for name,m,t,old,new,on,nn in jobs:
        a=res[old]; b=res[new]
        diff=[k for k in set(on)|set(nn) if a.get(k)!=b.get(k)]
        if diff: bad+=1; print("DIFF", name, m, t, diff)
    print(len(jobs), "points,", bad, "differ")
if __name__=="__main__":
    names=sys.argv[1].split(',') if len(sys.argv)>1 and sys.argv[1] else []
    Ts=[int(x) for x in sys.argv[2].split(',')] if len(sys.argv)>2 else [1,2,4,8,16,32,64]
    models=sys.argv[3].split(',') if len(sys.argv)>3 else ["qwen3-30b-a3b","qwen3-235b-a22b"]
    main(names,Ts,models)
