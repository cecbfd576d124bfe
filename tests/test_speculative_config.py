"""--speculative-config (tr_engine/core/speculative_config.py): vLLM's keys read, anything else refused in one line,
and each setting doing what it says: the method, the most draft tokens a step verifies, plain steps above a batch
size; always the same tokens as plain decoding."""

import pytest
import torch
from cli import assert_one_line_error, call_main
from curves import pinned

from tr_engine.core.speculative_config import REQUEST_KEYS, SpeculativeConfig
from tr_engine.errors import UserError


def test_vllm_keys_and_names_are_read():
    c = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 16, "disable_by_batch_size": 8}')
    assert (c.method, c.suffix, c.num_speculative_tokens, c.disable_by_batch_size) == ("hybrid", True, 16, 8)
    assert SpeculativeConfig.parse({"method": "ngram"}).method == "pld"
    assert SpeculativeConfig.parse({"max_concurrency": 4}).disable_by_batch_size == 4
    assert SpeculativeConfig.parse({}) == SpeculativeConfig()


@pytest.mark.parametrize("value, says", [
    ('{"num_speculative_token": 4}', "unknown key 'num_speculative_token'; did you mean 'num_speculative_tokens'"),
    ('{"method": "eagle"}', "method 'eagle' is not one of"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer of at least 1, got 0"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"disable_by_batch_size": 2, "max_concurrency": 2}', "both disable_by_batch_size and max_concurrency"),
    ("[1]", "must be a JSON object, got list"),
    ("{method: 1}", "is not valid JSON"),
])
def test_anything_else_is_refused_in_one_line(value, says):
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace("[", r"\[")):
        SpeculativeConfig.parse(value)


def test_a_request_may_set_only_its_own_keys():
    with pytest.raises(UserError, match="unknown key 'disable_by_batch_size'"):
        SpeculativeConfig.parse({"disable_by_batch_size": 2}, "speculative_config", REQUEST_KEYS)


def test_the_commands_refuse_a_typo_and_a_disagreeing_method():
    from tr_engine.cli.generate import main

    proc = call_main(main, "--prompt", "hi", "--speculative-config", '{"num_speculative_tokens": 4, "metod": "tr"}')
    assert_one_line_error(proc, "--speculative-config", "unknown key 'metod'", "did you mean 'method'")
    proc = call_main(main, "--prompt", "hi", "--method", "tr", "--speculative-config", '{"method": "pld"}')
    assert_one_line_error(proc, "--method tr", "(pld) disagree")


def test_each_setting_does_what_it_says_and_the_tokens_stay_plain_decodings(tiny_factory):
    from tr_engine.engine import Engine

    folder = str(tiny_factory("spec", dtype=torch.float64, vocab_size=300, std=0.5))
    prompts = ["the the the cat sat on the mat and the cat", "a b c a b c a b", "one two one two one"]
    plain = Engine.from_pretrained(folder, dtype="float64", max_context=512)
    want = [plain.generate(p, 40, method="ar", ignore_eos=True).token_ids for p in prompts]

    capped = Engine.from_pretrained(folder, dtype="float64", max_context=512, tree="2.2.2",
                                    speculative_config={"method": "tr", "num_speculative_tokens": 3})
    assert capped.method == "tr"
    for p, w in zip(prompts, want):
        g = capped.generate(p, 40, ignore_eos=True).generation
        assert g.token_ids == w and max(g.verify_tokens) == 4  # (the 2.2.2 tree cut to 3 nodes and the root)
    suffix = pinned(Engine.from_pretrained(folder, dtype="float64", max_context=512,
                                           speculative_config='{"method": "suffix", "num_speculative_tokens": 5}'))
    assert suffix.method == "hybrid" and suffix.drafting.suffix is not None
    assert suffix.drafting.suffix.capacity == (64 << 20) // 20  # (64 MB: suffix.BYTES_PER_TOKEN a token)
    for p, w in zip(prompts * 2, want * 2):  # (asked twice: the second time the index drafts)
        g = suffix.generate(p, 40, ignore_eos=True).generation
        assert g.token_ids == w and max(g.verify_tokens) <= 6
    assert g.drafts.by_source["suffix"][1] > 0
    # above the batch size, plain steps: three requests decoding together the whole way never draft
    for above, drafts in ((2, False), (3, True)):
        engine = pinned(Engine.from_pretrained(folder, dtype="float64", max_context=512, max_batch=3,
                                               speculative_config={"disable_by_batch_size": above}))
        got = engine.generate_batch(prompts, 40, method="hybrid", ignore_eos=True)
        assert [r.token_ids for r in got] == want
        assert any(r.generation.drafts.drafted for r in got) == drafts, above
