import subprocess, sys, torch, numpy as np
from blockflow.core import stage_files
subprocess.run([sys.executable, "scripts/export_example_model.py", "/tmp/ex/skipnet.pt2", "--blocks", "/tmp/ex/blocks"], check=True, capture_output=True)
prog = torch.export.load("/tmp/ex/skipnet.pt2").module()
x = torch.from_numpy(np.random.default_rng(7).standard_normal((3, 3, 32, 32), dtype=np.float32))
with torch.no_grad():
    want = prog(x)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
for bench in (True, False):
    torch.backends.cudnn.benchmark = bench
    for ext in ("pt2", "ts"):
        for opt in (True, False):
            stages = [stage_files.load_stage_file(f"/tmp/ex/blocks/stage{i}.{ext}").cuda().eval() for i in range(3)]
            errs = []
            with torch.jit.optimized_execution(opt), torch.inference_mode():
                for _ in range(5):
                    xs = (x.cuda(),)
                    for s in stages:
                        o = s(*xs); xs = tuple(o) if isinstance(o, (tuple, list)) else (o,)
                    errs.append(float((xs[0].cpu() - want).abs().max() / want.abs().max()))
            print("benchmark", bench, ext, "optimized", opt, ["%.1e" % e for e in errs], flush=True)
