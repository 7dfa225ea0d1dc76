# Compute multipliers at 1, 2, 3, 4, 8 and 16 layers (docs/experiments.md, "How much compute each design is worth, by
# depth"): does a design use depth better, and does it move the compute-optimal depth? Width 128, character-level
# Shakespeare (config/shakespeare_char_cpu.py's model and recipe), 5 seeds. The shallow end (1, 2, 3 layers) is there
# so that each budget's best depth has a measured depth on both sides (at 5e12 prenorm's 2 layers beat its 4 by 0.14,
# results/sweep_shakespeare_cpu.csv): an optimum on the grid's edge is named as one, and gives no frontier figure.
#
# The designs run at 2.5e12 and 1e13 training FLOPs; prenorm, the baseline, at 1.25e12 to 2e13 (5 budgets, 2x apart),
# half the designs' smallest budget and twice their largest, so that a design's loss is read inside the range
# prenorm measured (flops.py multiplier flags, and leaves out of the overall figure, any that is not).
# At 16 layers only the designs whose depth trend matters most here (nag, block_attnres, value_residual, mudd):
# attnres and mhc are the slowest per step on a CPU, and fewer designs beat fewer seeds.
#
# Each run's schedule: train.py turns the budget into iterations (max_flops / (FLOPs per token x 768 tokens)),
# decays the LR (cosine, 1e-3 to 1e-4) over all of them, and warms up for 100 iterations capped at 10% of them
# (rounded up). For prenorm (the designs' are up to 13% fewer, mhc's; their warm-ups follow the same cap):
#   layers   1.25e12      2.5e12       5e12          1e13          2e13        (iterations, warm-up)
#   1        1226, 100    2451, 100    4903, 100     9806, 100     19612, 100
#   2        625, 63      1249, 100    2498, 100     4997, 100     9994, 100
#   3        419, 42      838, 84      1676, 100     3353, 100     6705, 100
#   4        315, 32      631, 64      1261, 100     2523, 100     5045, 100
#   8        158, 16      317, 32      634, 64       1267, 100     2535, 100
#   16       79, 8        159, 16      318, 32       635, 64       1271, 100
# Every run ends with train.py's final eval on the whole val split (111,360 tokens, the same for every run), which is
# the val_loss the multipliers read.
#
# A cell under 300 optimizer steps (8 layers at 1.25e12, 16 at 1.25e12 and 2.5e12) is short: flops.py multiplier
# prints it but leaves it out of every headline figure (config/sweep_depth_halfbatch_cpu.py checks one at half batch).
#
# Up to 1e13 prenorm's best depth is 1 layer; at 2e13 it is 2, with 1 and 3 beside it: the one budget where the
# optimum is inside the grid. So nag and mudd also run there, at 1 to 4 layers: does a design move that optimum?
# (A 1-layer best is bracketed too, from below, by the lowest loss any 0-layer model can reach: flops.py multiplier
# --val_bin=data/shakespeare_char/val.bin.)
#
# 34 design cells x 2 budgets + 8 of them at 2e13 + 6 baseline cells x 5 budgets, x 5 seeds: 530 runs, about 15
# hours on 2 cores (python flops.py plan config/sweep_depth_multiplier_cpu.py --like=results/sweep_depth_multiplier_cpu.csv:
# the committed runs' seconds per FLOP; the 235 runs at 4, 8 and 16 layers took 6), two at a time, smallest budget
# first, seed by seed (resumable: run it again; finished runs are skipped; --cells="['prenorm_L1', ...]" runs some
# cells first, and --cell_budgets="{'nag_L2': [2e13]}" some budgets of them):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_depth_multiplier_cpu.py
# python flops.py multiplier out/sweep_depth_multiplier_cpu/results.csv

sweep_name = "sweep_depth_multiplier_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=50"]
budgets = [2.5e12, 1e13]  # the designs'
depths, residuals = [], []  # no grid: the cells are named below
_designs = {  # (private: a leading _) the cells' keys, and their depths (a cell at each: <design>_L<depth>)
    "nag": ({"residual": "nag"}, (1, 2, 3, 4, 8, 16)),
    "block_attnres": ({"residual": "block_attnres"}, (1, 2, 3, 4, 8, 16)),
    "attnres": ({"residual": "attnres"}, (1, 2, 3, 4, 8)),
    "value_residual": ({"residual": "prenorm", "value_residual": "half"}, (1, 2, 3, 4, 8, 16)),  # ResFormer
    "mudd": ({"residual": "mudd"}, (1, 2, 3, 4, 8, 16)),  # MUDDFormer
    "mhc": ({"residual": "mhc"}, (1, 2, 3, 4, 8)),
}
_depths = (1, 2, 3, 4, 8, 16)  # the baseline's
runs = [(f"prenorm_L{L}", {"residual": "prenorm", "n_layer": L}) for L in _depths]  # the baseline at each depth
runs += [(f"{name}_L{L}", {**keys, "n_layer": L}) for name, (keys, depths_of) in _designs.items() for L in depths_of]
cell_budgets = {f"prenorm_L{L}": [1.25e12, 2.5e12, 5e12, 1e13, 2e13] for L in _depths}
cell_budgets |= {f"{name}_L{L}": [2.5e12, 1e13, 2e13] for name in ("nag", "mudd") for L in (1, 2, 3, 4)}  # the frontier
seeds = [1, 2, 3, 4, 5]
jobs = 2
