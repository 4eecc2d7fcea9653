import os, sys, time, torch, triton
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
print("triton", triton.__version__, torch.__version__, torch.cuda.get_device_name())
from fleetlab.attention import triton_kernels as tk
import test_triton_kernels as T
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
def bench(shape, rows, qlen, dtype=torch.bfloat16):
    bs, kv, g, d = shape
    b = T._batch_for(shape, dtype, [qlen]*rows, [0]*rows, seed=1, poison=0.0)
    geo = tk.LayerGeometry.of(b["query"], b["key_cache"], b["value_cache"])
    res = {}
    from fleetlab.attention import gluon_prefill as gp
    default_cfg = gp.kernel_config
    for name, env, ov in (("gluon", "1", False), ("portable", "0", False), ("gluon_overlap", "1", True)):
        os.environ["FLEETLAB_GLUON_PREFILL"] = env
        gp.kernel_config = lambda d, _o=ov: default_cfg(d, _o)
        plan = tk.plan_prefill(geo, b["block_tables"], b["seq_lens_kv"], b["cu_seqlens_q"], num_tokens=rows*qlen,
                               first_row=0, num_rows=rows, max_query_len=qlen)
        out = torch.empty_like(b["query"])
        f = lambda: plan.run(b["query"], b["key_cache"], b["value_cache"], scale=d**-0.5, out=out)
        f(); torch.cuda.synchronize()
        res[name] = (triton.testing.do_bench(f, warmup=50, rep=300), out.clone())
    gp.kernel_config = default_cfg
    q = b["query"].view(rows, qlen, kv*g, d).transpose(1, 2)
    k = torch.randn(rows, kv, qlen, d, device="cuda", dtype=dtype).repeat_interleave(g, 1) if False else torch.randn(rows, kv*g, qlen, d, device="cuda", dtype=dtype)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fc = lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=False)
        fc(); res["cudnn"] = (triton.testing.do_bench(fc, warmup=50, rep=300), None)
    err = max((res[n][1].float() - res["portable"][1].float()).abs().max().item() for n in ("gluon", "gluon_overlap"))
    print(shape, rows, qlen, {k: round(v[0]*1000, 1) for k, v in res.items()},
          "gluon/cudnn %.2f overlap/cudnn %.2f portable/cudnn %.2f maxdiff %.3g" % (res["cudnn"][0]/res["gluon"][0], res["cudnn"][0]/res["gluon_overlap"][0], res["cudnn"][0]/res["portable"][0], err), flush=True)
for shape, rows, qlen in [((16, 8, 4, 128), 1, 8192), ((64, 8, 4, 128), 8, 2048), ((16, 16, 1, 64), 2, 4096),
                          ((16, 4, 4, 256), 4, 2048)]:
    try:
        bench(shape, rows, qlen)
    except Exception as e:
        print("FAIL", shape, repr(e)[:3000], flush=True)
