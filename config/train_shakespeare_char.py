# nanoGPT's "baby GPT" on character-level tiny Shakespeare, for one GPU (minutes on an A100/H100).
# python train.py config/train_shakespeare_char.py [--residual=nag]

out_dir = "out-shakespeare-char"
eval_interval = 250  # the model overfits on this small data, so evaluate often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep only the best-val checkpoint

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # context of up to 256 characters

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # a small model can take a larger lr
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99  # a bit larger because there are few tokens per iteration
warmup_iters = 100
