"""``generate``'s figures: what each one times, so that ``llmcore run``'s and
``llmcore_runner``'s compare."""

import time

import torch

from llmcore.runtime.generate import Sampling, generate


class SlowPrompt:
    """A stand-in program with a KV cache: the prompt's call takes ``prompt_s``, a decode
    step nothing; the logits always favour token 3."""

    use_kv_cache = True
    max_seq_len = max_context_len = 64
    eos_ids: list[int] = []

    def __init__(self, prompt_s: float):
        self.prompt_s = prompt_s

    def logits(self, tokens, input_pos=None):
        if len(tokens) > 1:
            time.sleep(self.prompt_s)
        row = torch.zeros(8)
        row[3] = 1.0
        return row


def test_prefill_rate_counts_the_prompts_calls_and_time_to_first_token_everything_before_it():
    handed_on = []

    def on_token(token: int) -> None:  # a slow consumer of the first token (writing its text, say)
        if not handed_on:
            time.sleep(0.3)
        handed_on.append(token)

    prompt = [5, 6, 7, 8]
    stats = generate(SlowPrompt(prompt_s=0.05), prompt, 3, Sampling(), on_token=on_token, stop_at_eos=False).stats
    prompt_s = len(prompt) / stats.prefill_tok_s
    assert 0.05 <= prompt_s < 0.25, prompt_s  # the prompt's call, not the consumer's 0.3 s
    assert stats.time_to_first_token_s >= 0.35  # the call and the first token's consumer
    assert handed_on == [3, 3, 3]
