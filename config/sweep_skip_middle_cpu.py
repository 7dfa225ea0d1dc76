# skip-middle against shallower dense models at equal training FLOPs (Lawson & Aitchison's comparison):
# sandwich + mod=skip_middle at 8 layers against dense sandwich at 6 and 8 layers, each on the FLOPs
# of 1000 iterations of the dense 8-layer sandwich. skip_middle's iterations come from its dense count
# (its gates decide what it skips), so it spends at most the budget; results.md has the realised FLOPs.
# 3 seeds, 9 runs, about 10 minutes on 2 cores (measured; each run about 2 minutes on one core):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_skip_middle_cpu.py

sweep_name = "sweep_skip_middle_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 7.89e12  # 1000 iterations of dense 8-layer sandwich: 1.0274e7 training FLOPs/token x 768 tokens
depths, residuals = [], []
runs = [
    ("sandwich_L8", {"residual": "sandwich", "n_layer": 8}),
    ("sandwich_L6", {"residual": "sandwich", "n_layer": 6}),
    ("sandwich_L8_skip_middle0.25", {"residual": "sandwich", "n_layer": 8, "mod": "skip_middle", "mod_rate": 0.25}),
]
seeds = [1, 2, 3]
jobs = 2
