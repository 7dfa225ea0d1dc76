# The learning rate at 8 layers, for each optimizer and design (docs/experiments.md, "Muon against AdamW"): Muon's
# LR (0.02) and AdamW's (1e-3, the recipe's) were chosen on prenorm at 4 layers. Here both are checked where the
# Muon comparison is read, at 8 layers and 5e12 FLOPs: the chosen LR and 2.5x either side for Muon, 2x for AdamW,
# and AdamW's 4e-3 too (its 2e-3 was best at the top of the first three, for every design: 4e-3 brackets it), for
# prenorm, the 5 designs the Muon comparison runs and attnres (the depth grid's sixth), 1 seed. The
# seed is 11, no seed of an evaluated cell (those run seeds 1 to 5): a run that chose an LR is never also a run its
# choice is judged on.
#
# 7 designs x 7 (optimizer, LR) = 49 runs, about 0.9 hours on 2 cores, two at a time (flops.py plan ... --like=
# results/sweep_depth_multiplier_cpu.csv; resumable):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_lr_check_cpu.py
# python flops.py results results/sweep_lr_check_cpu.csv   # every (design, optimizer, LR) cell's final val loss

sweep_name = "sweep_lr_check_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=50"]
budget = 5e12
depths, residuals = [], []  # no grid: the cells are named below
_designs = [  # (private: a leading _) the Muon comparison's designs (config/sweep_muon_cpu.py)
    ("prenorm", {"residual": "prenorm"}),
    ("nag", {"residual": "nag"}),
    ("block_attnres", {"residual": "block_attnres"}),
    ("value_residual", {"residual": "prenorm", "value_residual": "half"}),  # ResFormer
    ("mudd", {"residual": "mudd"}),  # MUDDFormer
    ("mhc", {"residual": "mhc"}),
    ("attnres", {"residual": "attnres"}),  # in the depth grid, not the Muon comparison
]
runs = [(f"{name}_L8_{opt}_lr{lr:g}", {**keys, "n_layer": 8, "optimizer": opt, key: lr})
        for name, keys in _designs
        for opt, key, lr in [("adamw", "learning_rate", 5e-4), ("adamw", "learning_rate", 1e-3),
                             ("adamw", "learning_rate", 2e-3), ("adamw", "learning_rate", 4e-3),
                             ("muon", "muon_lr", 0.008), ("muon", "muon_lr", 0.02), ("muon", "muon_lr", 0.05)]]
seeds = [11]
jobs = 2
