# GPT-2 small (124M) on OpenWebText: about 300B tokens over 600k iterations, as nanoGPT.
# One node of 8 GPUs:  torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_owt.py
# One GPU: the same command line with python train.py; gradient accumulation keeps the batch size.
# Data first: python data/openwebtext/prepare.py

out_dir = "out-gpt2-owt"
eval_interval = 1000
eval_iters = 200
log_interval = 10

dataset = "openwebtext"
# 12 batch * 1024 block * 40 accumulation = 491,520 tokens per iteration
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
warmup_iters = 2000

compile = True
