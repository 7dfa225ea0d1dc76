# An iso-FLOP depth sweep on character-level Shakespeare: width 128, 2/4/8 layers, three residual
# modes and nag with mod=nag at 0.25, each run trained on the same 5e12 FLOPs. 12 cells x 3 seeds,
# 36 runs, two at a time:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_shakespeare_cpu.py

sweep_name = "sweep_shakespeare_cpu"
train_config = "config/shakespeare_char_cpu.py"  # width 128, 4 heads, 12 x 64 tokens per iteration
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 5e12  # 1250 iterations at 4 layers: the quickstart's 2000 iterations cost 8e12
depths = [2, 4, 8]
residuals = ["prenorm", "nag", "block_attnres"]
mod_runs = [("nag", "nag", 0.25)]  # nag with mod=nag at mod_rate 0.25, at every depth
seeds = [1, 2, 3]
jobs = 2
