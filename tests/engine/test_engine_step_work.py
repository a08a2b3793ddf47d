"""`Engine.last_step` reports what a step computed: rows, decoded and prefilled tokens, and the
tokens resident in the KV pool after it (what a device cost model charges for)."""

from engine_testlib import greedy, make_engine, prompts, tiny_model

from dorarl.engine import StepWork


def test_step_work_counts_prefill_chunks_decodes_and_resident_tokens():
    engine = make_engine(tiny_model("llama", seed=1), prefill_chunk_size=8, max_num_seqs=4)
    assert engine.last_step == StepWork()
    a, b = prompts([5, 7], seed=2)
    engine.add_request("a", a, greedy(4))
    engine.add_request("b", b, greedy(2))
    engine.step()  # a's whole prompt (5, then its 1st token), b's first 3: budget 8
    assert engine.last_step == StepWork(rows=2, prefill_tokens=8, resident_tokens=8)
    assert engine.last_step.extra_tokens == 6
    engine.step()  # a decodes its 2nd; b finishes its prompt (4 more), samples its 1st
    assert engine.last_step == StepWork(
        rows=2, decode_tokens=1, prefill_tokens=4, resident_tokens=13
    )
    engine.step()  # both decode: b has its 2 tokens and leaves the pool, a holds 5 + 2
    assert engine.last_step == StepWork(rows=2, decode_tokens=2, resident_tokens=7)
    engine.step()  # a alone samples its 4th token and finishes
    assert engine.last_step == StepWork(rows=1, decode_tokens=1, resident_tokens=0)
    assert not engine.has_unfinished()
