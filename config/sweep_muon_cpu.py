# Does each design's gain survive Muon? Six designs under --optimizer=muon at 4 and 8 layers (width 128),
# at two budgets 4x apart (1.25e12 and 5e12 training FLOPs, each design's extra FLOPs counted), 3 seeds.
# The AdamW runs of the same cells (same recipe, seeds and budgets) are earlier sweeps' (docs/experiments.md,
# "Muon"); the 8-layer 1.25e12 ones are config/sweep_muon_adamw_cpu.py. Muon's LR, 0.02, is the best of
# config/sweep_muon_lr_cpu.py's three on prenorm alone (0.008, 0.02, 0.05), and every design gets it; AdamW
# trains the embedding, head, norms, gains and mixing weights at the recipe's LR (1e-3) beside it. Each
# run's schedule is the recipe's: warm-up min(100, ceil(10% of its iterations)), cosine to 1e-4 at its end.
# 72 runs, two at a time, smallest budget first (resumable: run it again); about 1.5 hours on 2 idle cores:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_muon_cpu.py
# python flops.py optimizers results/sweep_muon_*.csv results/sweep_multiplier_cpu.csv results/sweep_shakespeare*_cpu.csv

sweep_name = "sweep_muon_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budgets = [1.25e12, 5e12]
depths, residuals = [], []  # no grid: the cells are named below
runs = [(f"{name}_L{L}_muon", {**options, "n_layer": L, "optimizer": "muon", "muon_lr": 0.02})
        for L in (4, 8) for name, options in [
            ("prenorm", {"residual": "prenorm"}),  # the baseline: first at its depth
            ("nag", {"residual": "nag"}),
            ("block_attnres", {"residual": "block_attnres"}),
            ("value_residual", {"residual": "prenorm", "value_residual": "half"}),  # ResFormer
            ("mudd", {"residual": "mudd"}),  # MUDDFormer
            ("mhc", {"residual": "mhc"}),
        ]]
seeds = [1, 2, 3]
jobs = 2
