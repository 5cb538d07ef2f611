"""Hugging Face transformers models for the correctness zoo, built from tiny configs (nothing is
downloaded).

Each entry is a `zoo.ZooModel`: the loss is the one the model computes from `labels=`, a mean
over the rank's tokens (or images), so averaging the per-rank gradients is data-parallel
training. Dropout is off so that zrs and the reference see the same function. The causal and
seq2seq LMs also `generate()` after training: greedy decoding from one prompt on every rank.
The `_varlen` entries draw a new sequence length for every (rank, step), so ranks differ from
each other within a step and from one step to the next.
"""

from __future__ import annotations

import torch
import transformers as hf
from torch import Tensor, nn

from zoo import Batch, ZooModel, _gen

VOCAB, DIM, HEADS, LAYERS, FFN, MAX_LEN = 48, 16, 2, 2, 32, 32
SEQ = 8  # fixed-length batches: 2 sequences of SEQ tokens
VARLEN = (5, 13)  # the lengths a variable-length batch draws from (inclusive)
PROMPT_LEN, NEW_TOKENS = 4, 4


def _decoder_config(cls: type, **kw) -> hf.PretrainedConfig:
    return cls(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=1,  # grouped-query attention
        max_position_embeddings=MAX_LEN,
        **kw,
    )


def _llama() -> nn.Module:
    return hf.LlamaForCausalLM(_decoder_config(hf.LlamaConfig, attention_bias=True))


def _qwen2() -> nn.Module:  # biases on q, k, v; an untied head
    return hf.Qwen2ForCausalLM(_decoder_config(hf.Qwen2Config, tie_word_embeddings=False))


def _mistral() -> nn.Module:
    return hf.MistralForCausalLM(_decoder_config(hf.MistralConfig, sliding_window=None))


def _gpt2() -> nn.Module:  # Conv1D layers with biases, the head tied to the token embedding
    config = hf.GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_LEN,
        n_embd=DIM,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return hf.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = hf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=MAX_LEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return hf.BertForMaskedLM(config)


def _t5() -> nn.Module:  # encoder-decoder, relative position buckets, a tied head
    config = hf.T5Config(
        vocab_size=VOCAB,
        d_model=DIM,
        d_kv=DIM // HEADS,
        d_ff=FFN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return hf.T5ForConditionalGeneration(config)


IMAGE, PATCH, LABELS = 8, 4, 5


def _vit() -> nn.Module:
    config = hf.ViTConfig(
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return hf.ViTForImageClassification(config)


# --- batches and losses --------------------------------------------------------------------------


def _length(rank: int, step: int, salt: int) -> int:
    lo, hi = VARLEN
    return int(torch.randint(lo, hi + 1, (1,), generator=_gen(rank, step, salt)))


def _tokens(salt: int, varlen: bool = False):
    def batch(rank: int, step: int) -> Batch:
        length = _length(rank, step, salt + 100) if varlen else SEQ
        return (torch.randint(2, VOCAB, (2, length), generator=_gen(rank, step, salt)),)

    return batch


def _causal_loss(model: nn.Module, batch: Batch) -> Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _masked_batch(rank: int, step: int) -> Batch:
    g = _gen(rank, step, 20)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=g)
    masked = torch.rand(ids.shape, generator=g) < 0.3
    masked[:, 0] = True  # at least one masked token per row
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return (torch.where(masked, torch.ones_like(ids), ids), labels)


def _masked_loss(model: nn.Module, batch: Batch) -> Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _seq2seq_batch(rank: int, step: int) -> Batch:
    g = _gen(rank, step, 21)
    return (
        torch.randint(2, VOCAB, (2, SEQ), generator=g),
        torch.randint(2, VOCAB, (2, SEQ // 2), generator=g),
    )


def _seq2seq_loss(model: nn.Module, batch: Batch) -> Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _image_batch(rank: int, step: int) -> Batch:
    g = _gen(rank, step, 22)
    return (
        torch.randn(2, 3, IMAGE, IMAGE, generator=g),
        torch.randint(0, LABELS, (2,), generator=g),
    )


def _image_loss(model: nn.Module, batch: Batch) -> Tensor:
    pixels, labels = batch
    # .float(): with param_dtype=bf16 the logits are bf16; the model's loss follows them.
    return model(pixel_values=pixels, labels=labels).loss.float()


def generate(model: nn.Module) -> Tensor:
    """Greedy decoding of NEW_TOKENS tokens from one fixed prompt (the same on every rank, so
    that every rank runs the same number of forwards)."""
    prompt = torch.randint(2, VOCAB, (1, PROMPT_LEN), generator=_gen(0, 0, 30))
    prompt = prompt.to(next(model.parameters()).device)
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out.cpu()


def _causal(name: str, factory, salt: int, varlen: bool = False, **kw) -> list[ZooModel]:
    """The model, and with `varlen` also on variable-length batches (Llama without biases and
    GPT-2 with them: the mechanism is the same for every model, and the zoo must stay cheap)."""
    fixed = ZooModel(name, factory, _tokens(salt), _causal_loss, generate=generate, seed=salt, **kw)
    if not varlen:
        return [fixed]
    return [
        fixed,
        ZooModel(
            f"{name}_varlen", factory, _tokens(salt, varlen=True), _causal_loss, seed=salt, **kw
        ),
    ]


HF_ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        *_causal("hf_llama", _llama, 11, varlen=True),
        *_causal("hf_qwen2", _qwen2, 12),
        *_causal("hf_mistral", _mistral, 13),
        *_causal(
            "hf_gpt2",
            _gpt2,
            14,
            varlen=True,
            tied=(("transformer.wte.weight", "lm_head.weight"),),
        ),
        ZooModel("hf_bert", _bert, _masked_batch, _masked_loss, seed=15),
        ZooModel(
            "hf_t5",
            _t5,
            _seq2seq_batch,
            _seq2seq_loss,
            generate=generate,
            tied=(("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),),
            seed=16,
        ),
        ZooModel("hf_vit", _vit, _image_batch, _image_loss, seed=17),
    ]
}
