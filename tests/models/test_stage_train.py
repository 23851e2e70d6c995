"""The reward model being trained (models/stages/train.Scorer) scores each sequence at its last real token whatever
the pad id: with pad = EOS (a tokenizer without a pad token of its own), HF's pooling by pad id would read the token
before each EOS (TRL #937); ours matches every row scored alone, unpadded, and the RL stage's scorer
(models/reward.reward_model_scores) on the same batch."""

import torch

from models.reward import reward_model_scores
from models.stages.data import load_pairs, right_padded
from models.resolve import resolve_data
from models.stages.train import Scorer
from tests.conftest import free_port


def test_scores_are_read_at_the_last_real_token_when_pad_is_eos(tiny_models):
    scorer = Scorer.load(tiny_models["reward"], None, "float32", torch.device("cpu"))
    scorer.model.eval()
    eos = scorer.tokenizer.eos_token_id
    pairs = load_pairs(resolve_data("builtin:sentiment_preference", "reward_model.data"), "test", scorer.tokenizer)
    rows = pairs.chosen[:6] + pairs.rejected[:6]  # lengths differ, every row ends with EOS
    assert all(r[-1] == eos for r in rows) and len({len(r) for r in rows}) > 1
    tokens, lengths = right_padded(rows, eos)  # padded with EOS, as pad = EOS would
    with torch.no_grad():
        ours = scorer.scores(tokens, lengths)
        alone = torch.cat([scorer.scores(torch.tensor([r]), torch.tensor([len(r)])) for r in rows])
        inference = reward_model_scores(scorer.model, tokens, lengths)
        scorer.model.config.pad_token_id = eos  # HF's own pooling with pad = EOS
        mask = (torch.arange(tokens.shape[1]) < lengths[:, None]).long()
        naive = scorer.model(input_ids=tokens, attention_mask=mask).logits.squeeze(-1)
        again = scorer.scores(tokens, lengths)  # whatever pad id the config names, the same scores
    assert torch.allclose(ours, alone, atol=1e-5) and torch.allclose(ours, inference, atol=1e-5)
    assert not torch.allclose(ours, naive, atol=1e-3)  # the pitfall is real on this batch
    assert torch.allclose(again, ours, atol=1e-6) and scorer.model.config.pad_token_id == eos  # and restored it


def test_the_reward_model_trainer_shards_with_the_actors_mixed_precision_policy(tiny_models):
    """One precision policy (models/loading.base_dtype, distributed.shard_model): a full fine-tune of the reward model
    sharded with FSDP2 (here over a real one-rank gloo group) keeps float32 master weights and computes its blocks
    in the compute dtype, as the actor does: the weights a block's linear layers compute with are bf16, the
    sharded parameters float32."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        scorer = Scorer.load(tiny_models["reward"], None, "bfloat16", torch.device("cpu"), shard=True)
        assert scorer.sharded and {p.dtype for p in scorer.model.parameters()} == {torch.float32}
        seen = []
        linear = next(m for m in scorer.model.modules() if isinstance(m, torch.nn.Linear)
                      or type(m).__name__ == "Conv1D")
        linear.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
        tokens, lengths = torch.tensor([[5, 17, 30, 42, 8]]), torch.tensor([5])
        scorer.scores(tokens, lengths).sum().backward()
        assert seen == [torch.bfloat16]
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in scorer.model.parameters())
    finally:
        dist.destroy_process_group()
