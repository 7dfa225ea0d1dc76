# The designs of docs/modes.md's "DenseFormer", "Residual scalars", "MUDDFormer" and "Switches from
# other papers" in the iso-FLOP depth sweep of config/sweep_shakespeare_cpu.py (width 128, 5e12 training
# FLOPs per run, each design's extra FLOPs counted, so a costlier one trains fewer iterations), at 8
# layers, 3 seeds: the recipe of that sweep, whose prenorm, nag and block_attnres L8 runs are the
# baseline. At 4 layers the same cells are config/sweep_multiplier_cpu.py's 5e12 budget, beside every
# other mode. Read beside them with
# python flops.py results results/sweep_shakespeare_cpu.csv results/sweep_shakespeare_next_cpu.csv --baseline=prenorm_L8
# 18 runs, two at a time: 30 minutes on 2 idle cores (mhc_lite's and mudd's runs take up to twice prenorm's):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_shakespeare_next_cpu.py

sweep_name = "sweep_shakespeare_next_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 5e12
depths, residuals = [], []  # no grid: the cells are named below
runs = [(f"{name}_L{L}", {**options, "n_layer": L}) for L in (8,) for name, options in [
    ("dwa", {"residual": "dwa"}),  # DenseFormer, a DWA after every block
    ("scalars", {"residual": "scalars"}),  # nanochat's residual scalars
    ("mudd", {"residual": "mudd"}),  # MUDDFormer, four ways
    ("norm_scaling", {"residual": "prenorm", "norm_scaling": True}),  # LayerNorm Scaling
    ("value_residual", {"residual": "prenorm", "value_residual": "half"}),  # ResFormer
    ("mhc_lite", {"residual": "mhc", "mhc_res": "birkhoff"}),  # mHC-lite
]]
seeds = [1, 2, 3]
jobs = 2
