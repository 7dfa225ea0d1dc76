# The designs of docs/modes.md's "DenseFormer", "Residual scalars", "MUDDFormer" and "Switches from
# other papers" in the iso-FLOP depth sweep of config/sweep_shakespeare_cpu.py (width 128, 5e12 training
# FLOPs per run, each design's extra FLOPs counted, so a costlier one trains fewer iterations), at 4
# and 8 layers, 3 seeds. Read beside prenorm, nag and block_attnres with
# python flops.py results docs/sweep_shakespeare_cpu.csv docs/sweep_shakespeare_next_cpu.csv
# 36 runs, two at a time: about 2.5 hours on 2 idle cores (7 to 8 minutes a run, mhc_lite's longer):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_shakespeare_next_cpu.py

sweep_name = "sweep_shakespeare_next_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 5e12
depths, residuals = [], []  # no grid: the cells are named below, at 4 and 8 layers
runs = [(f"{name}_L{L}", {**options, "n_layer": L}) for L in (4, 8) for name, options in [
    ("dwa", {"residual": "dwa"}),  # DenseFormer, a DWA after every block
    ("scalars", {"residual": "scalars"}),  # nanochat's residual scalars
    ("mudd", {"residual": "mudd"}),  # MUDDFormer, four ways
    ("norm_scaling", {"residual": "prenorm", "norm_scaling": True}),  # LayerNorm Scaling
    ("value_residual", {"residual": "prenorm", "value_residual": "half"}),  # ResFormer
    ("mhc_lite", {"residual": "mhc", "mhc_res": "birkhoff"}),  # mHC-lite
]]
seeds = [1, 2, 3]
jobs = 2
