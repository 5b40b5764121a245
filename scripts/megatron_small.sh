# Sourced by the Megatron device checks: the small model they train with
# megatron_patches.pretrain_gpt on mock data (4 layers, d256, GQA 4/2, vocab 1024) and the
# Megatron-LM flags our local-spec attention needs (the launcher refuses the others by name).
# Each check adds its sequence length, schedule and --sp-* flags.
MEGATRON_SMALL=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4
      --group-query-attention --num-query-groups 2
      --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0
      --bf16 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024
      --transformer-impl local --no-persist-layer-norm --no-rope-fusion
      --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
      --no-bias-dropout-fusion
      --no-create-attention-mask-in-dataloader --attention-dropout 0 --hidden-dropout 0
      --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
      --eval-iters 0 --eval-interval 1000000)
