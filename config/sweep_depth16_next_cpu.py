# The designs of docs/modes.md's "DenseFormer" and "Switches from other papers" in the 16-layer depth
# experiment (docs/experiments.md, "The stream against depth"): the settings of config/sweep_depth16_cpu.py
# (the quickstart recipe at 1000 iterations, equal iterations and tokens for every cell, with
# diagnostics), 3 seeds, with prenorm run again beside them as the baseline. 21 runs, two at a time;
# mhc's step costs 2.7x prenorm's on this CPU: about 1.5 hours on 2 cores with other work on the machine:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_depth16_next_cpu.py

sweep_name = "sweep_depth16_next_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--max_iters=1000", "--lr_decay_iters=1000", "--eval_interval=500", "--eval_iters=20",
              "--log_interval=250", "--diagnose=True"]
budget = None  # max_iters decides
depths, residuals = [], []  # no grid: the cells are named below
_L16 = {"n_layer": 16}
runs = [
    ("prenorm", {**_L16, "residual": "prenorm"}),
    ("dwa", {**_L16, "residual": "dwa"}),  # DenseFormer, a DWA after every block
    ("norm_scaling", {**_L16, "residual": "prenorm", "norm_scaling": True}),  # LayerNorm Scaling
    ("value_residual", {**_L16, "residual": "prenorm", "value_residual": "half"}),  # ResFormer
    ("mhc_lite", {**_L16, "residual": "mhc", "mhc_res": "birkhoff"}),  # mHC-lite
    ("scalars", {**_L16, "residual": "scalars"}),  # nanochat's residual scalars with an x0 lane
    ("mudd", {**_L16, "residual": "mudd"}),  # MUDDFormer, four ways
]
baseline = "prenorm"
seeds = [1, 2, 3]
jobs = 2
