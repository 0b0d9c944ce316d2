# task: causal_mask
# expect: causal_top_left
# seen: pytorch/pytorch#108108 and #103082 (is_causal aligned top-left: with a KV cache "the correct
#       attn_mask in this scenario should be [True, True, ..., True]"), onnx/onnx#8068, and
#       gittensor-ai-lab/sparkinfer#3 (causal mask misaligned when seqlen_q != seqlen_kv)
import torch


def causal_mask(q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril()  # query i sees keys 0..i
