# Compute multipliers (docs/flops.md, "Compute multipliers"): every residual design at 4 budgets spanning
# 8x, at one shape, 3 seeds. The shape is the quickstart's (4 layers, width 128, config/shakespeare_char_cpu.py):
# the depth at which the iso-FLOP sweep (results/sweep_shakespeare_cpu.csv) finds the designs closest to
# their best at 5e12 FLOPs, so the curves are not dominated by a too-deep model's slow start, and the one
# that fits the grid in about 3 hours on 2 cores. The top budget, 5e12, is that sweep's: its prenorm and
# block_attnres runs repeat results/sweep_shakespeare_cpu.csv's L4 runs to the digit (nag's within 2e-4).
# Each run's schedule: train.py turns the budget into iterations, decays the LR (cosine, 1e-3 to 1e-4) over all of
# them, and warms up for the recipe's 100 iterations capped at 10% of them (rounded up). For prenorm: 158, 315, 631
# and 1261 iterations at 6.25e11, 1.25e12, 2.5e12 and 5e12, warm-up 16, 32, 64 and 100 (the designs' iterations
# are up to 16% fewer: mhc_lite 1058 at 5e12, mhc 1095; their warm-ups follow the same cap).
# 11 designs x 4 budgets x 3 seeds, 132 runs, two at a time, smallest budget first (resumable: run it again):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_multiplier_cpu.py
# python flops.py multiplier out/sweep_multiplier_cpu/results.csv

sweep_name = "sweep_multiplier_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=50"]
budgets = [6.25e11, 1.25e12, 2.5e12, 5e12]
depths, residuals = [], []  # no grid: the cells are named below
runs = [
    ("prenorm", {"residual": "prenorm"}),  # the baseline
    ("nag", {"residual": "nag"}),
    ("block_attnres", {"residual": "block_attnres"}),
    ("attnres", {"residual": "attnres"}),
    ("dwa", {"residual": "dwa"}),  # DenseFormer
    ("scalars", {"residual": "scalars"}),  # nanochat's residual scalars
    ("norm_scaling", {"residual": "prenorm", "norm_scaling": True}),  # LayerNorm Scaling
    ("value_residual", {"residual": "prenorm", "value_residual": "half"}),  # ResFormer
    ("mhc", {"residual": "mhc"}),
    ("mhc_lite", {"residual": "mhc", "mhc_res": "birkhoff"}),  # mHC-lite
    ("mudd", {"residual": "mudd"}),  # MUDDFormer, four ways
]
runs = [(name, {**options, "n_layer": 4}) for name, options in runs]
baseline = "prenorm"
seeds = [1, 2, 3]
jobs = 2
