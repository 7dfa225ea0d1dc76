# Compute multipliers by depth on a GPU (docs/experiments.md, "The same experiment on a GPU"): the CPU grid
# (config/sweep_depth_multiplier_cpu.py) at a scale where the papers' claims live: OpenWebText (GPT-2 BPE), width
# 512 (8 heads), 2, 3, 6, 12 and 24 layers, 64 x 1024 tokens per iteration, bf16, compiled; nanoGPT's recipe
# (config/train_gpt2_owt.py: AdamW, LR 6e-4 to 6e-5, 2000 warm-up iterations capped at 10% of a run).
#
# The designs at 3e16 and 3e17 training FLOPs (10x); prenorm, the baseline, from 1.5e16 to 6e17 (40x), half the
# designs' smallest budget and twice their largest. 3 seeds. 6 layers at 3e16 train on 0.16B tokens, 24 layers at
# 3e17 on 0.5B (about 1,500 and 7,600 iterations). The shallow end (2 and 3 layers, as the CPU grid's 1 to 3) is
# there so that each budget's best depth has a measured depth on both sides: flops.py multiplier names an optimum on
# the grid's edge and gives it no frontier figure.
#
# Its cost, before it runs: python flops.py plan config/sweep_depth_multiplier_gpu.py --gpu=H100 --mfu=0.35
# (about 37 hours on one H100 at 35% MFU, 22 of them without the 2- and 3-layer cells; it prints the hours per
# budget). Then, on the GPU:
#   python data/openwebtext/prepare.py                                    # once: the tokens (needs the network)
#   python flops.py sweep config/sweep_depth_multiplier_gpu.py            # resumable: run it again
#   for k in 1 2 3; do python bench.py --section=steps --sweep=config/sweep_depth_multiplier_gpu.py \
#       --steps_out=out/step_times_gpu_$k.csv; done                   # 3 runs: the drift between runs is measured
#   python flops.py multiplier out/sweep_depth_multiplier_gpu/results.csv \
#       --step_times=out/step_times_gpu_1.csv,out/step_times_gpu_2.csv,out/step_times_gpu_3.csv

sweep_name = "sweep_depth_multiplier_gpu"
train_config = "config/train_gpt2_owt.py"
train_args = ["--n_embd=512", "--n_head=8", "--batch_size=16", "--gradient_accumulation_steps=4",
              "--eval_interval=500", "--eval_iters=50", "--log_interval=50"]
budgets = [3e16, 3e17]  # the designs'
depths, residuals = [], []  # no grid: the cells are named below
_designs = {  # (private: a leading _) the cells' keys, and their depths (a cell at each: <design>_L<depth>)
    "nag": ({"residual": "nag"}, (2, 3, 6, 12, 24)),
    "block_attnres": ({"residual": "block_attnres"}, (2, 3, 6, 12, 24)),
    "attnres": ({"residual": "attnres"}, (2, 3, 6, 12, 24)),
    "value_residual": ({"residual": "prenorm", "value_residual": "half"}, (2, 3, 6, 12, 24)),  # ResFormer
    "mudd": ({"residual": "mudd"}, (2, 3, 6, 12, 24)),  # MUDDFormer
    "mhc": ({"residual": "mhc"}, (2, 3, 6, 12, 24)),
}
_depths = (2, 3, 6, 12, 24)  # the baseline's
runs = [(f"prenorm_L{L}", {"residual": "prenorm", "n_layer": L}) for L in _depths]  # the baseline at each depth
runs += [(f"{name}_L{L}", {**keys, "n_layer": L}) for name, (keys, depths_of) in _designs.items() for L in depths_of]
cell_budgets = {f"prenorm_L{L}": [1.5e16, 3e16, 1e17, 3e17, 6e17] for L in _depths}
seeds = [1, 2, 3]
jobs = 1
