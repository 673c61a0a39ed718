"""The front's incremental decoder (`HFCodec.decoder()`, atombatch/serve/tokens.py: the engine's
`Detokenizer`): the pieces a stream sends, joined with the final flush, are the whole decode of
its ids, however the ids are grouped into steps, on the tokenizer kinds that decode differently in
a window than at the start (byte-level BPE with byte tokens that split UTF-8 sequences,
Metaspace's leading space, glued pieces), special tokens skipped or shown as the request asks;
`spaces_between_special_tokens` and the stop id as vLLM has them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.sampling_models import piece_tokenizer
from support.structured import byte_tokenizer

from atombatch.api.structs import SamplingParams
from atombatch.serve.tokens import HFCodec, IdCodec


def metaspace_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "</s>", "▁", "▁a", "▁bc", "d", "e", "▁é", "ü", "▁日本", "語", "x▁y"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens(["</s>"])
    return tok


TOKENIZERS = {"byte-bpe": byte_tokenizer(), "metaspace": metaspace_tokenizer(),
              "pieces": piece_tokenizer()}


def codec(tok: Any) -> HFCodec:
    return HFCodec(tok)


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "shown"])
@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_pieces_join_to_the_whole_decode(kind: str, skip: bool,
                                                  data: st.DataObject) -> None:
    tok = TOKENIZERS[kind]
    size = tok.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, size - 1), max_size=40))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    decoder = codec(tok).decoder((), SamplingParams(skip_special_tokens=skip))
    pieces, at = [], 0
    for cut in [*cuts, len(ids)]:
        piece = decoder.step(ids[at:cut])
        pieces.append(piece)
        at = cut
    whole = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) + decoder.flush() == whole
    # nothing sent early is ever taken back: every prefix of pieces is a prefix of the decode
    assert whole.startswith("".join(pieces))


@pytest.mark.parametrize("kind", [*sorted(TOKENIZERS), "ids"])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_one_token_steps_mixed_with_steps_of_several_give_the_same_pieces(
        kind: str, data: st.DataObject) -> None:
    """`step_one(t)` (the per-token path of a plain stream) is `step((t,))`, interleaved with
    steps of several tokens (a stream that fell behind) on the same decoder."""
    made = (lambda: IdCodec().decoder()) if kind == "ids" else \
        (lambda: codec(TOKENIZERS[kind]).decoder())
    size = 1024 if kind == "ids" else TOKENIZERS[kind].get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, size - 1), max_size=40))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(ids)), max_size=12))))
    one, many = made(), made()
    at = 0
    for cut in [*cuts, len(ids)]:
        part = ids[at:cut]
        if len(part) == 1:
            assert one.step_one(part[0]) == many.step(part)
        else:
            assert one.step(part) == many.step(part)
        at = cut
    assert one.flush() == many.flush()


def test_a_split_utf8_sequence_is_held_back_until_it_completes() -> None:
    tok = TOKENIZERS["byte-bpe"]
    # the bytes of one character as separate byte tokens (the BPE alphabet has every byte)
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_ids = [tok.token_to_id(ch) for ch in sorted(alphabet)]
    assert all(i is not None for i in byte_ids)
    euro = "€".encode()                                  # three bytes
    mapping = {b: ch for b, ch in zip(range(256), _bytes_to_unicode(), strict=True)}
    ids = [tok.token_to_id(mapping[b]) for b in euro]
    decoder = codec(tok).decoder()
    assert decoder.step(ids[:1]) == "" and decoder.step(ids[1:2]) == ""
    assert decoder.step(ids[2:]) == "€"
    # cut at the end: the whole decode's replacement character, once
    decoder = codec(tok).decoder()
    assert decoder.step(ids[:2]) == ""
    assert decoder.flush() == tok.decode(ids[:2], skip_special_tokens=True)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (what ByteLevel's alphabet spells bytes as)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def wordpiece_tokenizer() -> Any:
    """BERT's decoder: it writes a space before every word, added tokens included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "##s": 4, "world": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    return tok


@pytest.mark.parametrize("one", [False, True], ids=["step", "step_one"])
def test_spaces_between_special_tokens_false_glues_added_tokens_in_a_row(one: bool) -> None:
    """vLLM's rule: with special tokens shown and `spaces_between_special_tokens` false, an
    added token right after another is its bare content; the default keeps the decoder's
    spaces; with special tokens skipped the field changes nothing."""
    tok = wordpiece_tokenizer()
    ids = [3, 1, 2, 5, 4, 2, 1]

    def text(**params: Any) -> str:
        decoder = codec(tok).decoder((), SamplingParams(**params))
        pieces = [decoder.step_one(t) if one else decoder.step([t]) for t in ids]
        return "".join(pieces) + decoder.flush()

    assert text(skip_special_tokens=False) == "hello [CLS] [SEP] worlds [SEP] [CLS]" == \
        tok.decode(ids, skip_special_tokens=False)
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "hello [CLS][SEP] worlds [SEP][CLS]"
    assert text(spaces_between_special_tokens=False) == text() == "hello worlds"


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_id_that_ends_a_request_is_not_text(include: bool) -> None:
    """vLLM leaves the id that ended a request (EOS or a stop id) out of the text, special or
    not, unless `include_stop_str_in_output`; the ids before it are text as usual."""
    tok = wordpiece_tokenizer()
    for stop in (2, 5):  # a special EOS, a plain word as a stop id
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        decoder = codec(tok).decoder((), params)
        text = decoder.step([3]) + decoder.finish([4, stop], stop_id=True)
        ids = [3, 4, stop] if include else [3, 4]
        assert text == tok.decode(ids, skip_special_tokens=False)
        cut = codec(tok).decoder((), params)  # a request cut by max_tokens keeps its last id
        assert cut.step([3]) + cut.finish([4, stop], stop_id=False) == \
            tok.decode([3, 4, stop], skip_special_tokens=False)


def test_logprob_token_strings_keep_a_metaspace_words_leading_space() -> None:
    """vLLM's token strings: an id decoded alone with special tokens shown; a SentencePiece
    (Metaspace) word keeps the leading space a lone decode strips; other tokenizers as decoded."""
    tok = TOKENIZERS["metaspace"]
    meta = codec(tok)
    alone = [tok.decode([i], skip_special_tokens=False) for i in range(12)]
    assert alone[3:5] == ["a", "bc"]  # what the lone decode strips
    assert [meta.token_text(i) for i in range(12)] == \
        ["<unk>", "</s>", " ", " a", " bc", "d", "e", " é", "ü", " 日本", "語", alone[11]]
    wordpiece = codec(wordpiece_tokenizer())
    assert [wordpiece.token_text(i) for i in (1, 3, 4)] == ["[CLS]", "hello", "##s"]
    assert IdCodec().token_text(7) == "<7>"
