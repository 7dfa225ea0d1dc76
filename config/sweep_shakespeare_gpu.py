# An iso-FLOP depth sweep at nanoGPT's baby-GPT width (384, 6 heads, 64 x 256 tokens per iteration)
# for one GPU: 6 to 48 layers, every residual mode, each run trained on the same 1e16 FLOPs
# (6 layers: about 8,500 iterations; 48 layers: about 1,200).
# python flops.py sweep config/sweep_shakespeare_gpu.py

sweep_name = "sweep_shakespeare_gpu"
train_config = "config/train_shakespeare_char.py"
train_args = ["--compile=True"]
budget = 1e16
depths = [6, 12, 24, 48]
residuals = ["prenorm", "sandwich", "nag", "attnres", "block_attnres", "hc", "mhc"]
mod_runs = [("nag", "nag", 0.25), ("nag", "nag", 0.5)]  # nag with mod=nag at 0.25 and 0.5, at every depth
