"""`llmserve bench detokenize` on a small workload: streams, rows and the table (never times)."""

from __future__ import annotations

from benchmarks import detokenize
from services import cli
from tests.unit.test_detokenizer import MODEL_TOKENIZER


def test_streams_are_seeded_corpus_ids_one_per_message() -> None:
    streams = detokenize.build_streams(MODEL_TOKENIZER, 3, 40, seed=1)
    again = detokenize.build_streams(MODEL_TOKENIZER, 3, 40, seed=1)
    assert [s.token_ids for s in streams] == [s.token_ids for s in again]
    assert all(len(s.token_ids) == len(s.messages) == 40 for s in streams)
    assert len({tuple(s.token_ids) for s in streams}) > 1  # each from its own offset


def test_merged_messages_carry_the_same_text_in_fewer_messages() -> None:
    streams = detokenize.build_streams(MODEL_TOKENIZER, 4, 50, seed=0)
    rows = [
        detokenize.measure(MODEL_TOKENIZER, streams, k, detokenize.DEFAULT_STOPS, repeats=1)
        for k in (1, 4)
    ]
    # measure() checks each stream's text against its one-shot decode.
    assert rows[0].num_messages > rows[1].num_messages >= 4 * 50 // 4
    assert all(r.num_tokens == 4 * 50 and r.seconds > 0 for r in rows)
    table = detokenize.table(4, rows)
    assert table.splitlines()[0].startswith("| streams | tokens per message |")
    assert "1.00x" in table


def test_the_command_is_registered() -> None:
    args = cli.build_parser().parse_args(["bench", "detokenize", "--streams", "2", "--no-stop"])
    assert args.func is detokenize.run
    assert args.streams == 2 and args.no_stop and args.tokens_per_message == "1,2,4,8,16"
