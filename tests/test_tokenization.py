"""ElmoTokenizer: char-id rows, word splitting with offsets, padding, collators, decoding, saving.

Expected rows are written out by hand from the bilm-tf scheme: begin-of-word 258, end-of-word 259,
padding 260, UTF-8 byte b, every id shifted by +1 (so 259, 260, 261 and b + 1), 50 per word.
"""

import numpy as np
import pytest
import torch
from transformers import DataCollatorForTokenClassification, DataCollatorWithPadding

from hf_elmo.configuration_elmo import char_ids_to_word
from hf_elmo.tokenization_elmo import ElmoTokenizer


BOW, EOW, PAD = 259, 260, 261


def row(*inner):
    """A 50-id row from its shifted inner ids."""
    ids = [BOW, *inner, EOW]
    return ids + [PAD] * (50 - len(ids))


def shifted(text):
    return [b + 1 for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def tok():
    return ElmoTokenizer()


# ---------------------------------------------------------------------------------------------
# Character rows
# ---------------------------------------------------------------------------------------------
def test_row_of_a_is_written_out_by_hand(tok):
    expected = [259, 98, 260] + [261] * 47
    assert tok.convert_tokens_to_ids("a") == expected
    assert tok("a")["input_ids"] == [expected]
    assert tok(["a"], is_split_into_words=True)["input_ids"] == [expected]


def test_rows_of_ascii_and_non_ascii_words(tok):
    assert tok.convert_tokens_to_ids("Hi") == row(73, 106)
    # naïve: ï is C3 AF
    assert tok.convert_tokens_to_ids("naïve") == row(111, 98, 0xC3 + 1, 0xAF + 1, 119, 102)
    # 日本語: E6 97 A5 | E6 9C AC | E8 AA 9E
    assert tok.convert_tokens_to_ids("日本語") == row(231, 152, 166, 231, 157, 173, 233, 171, 159)
    # 😀 U+1F600: F0 9F 98 80
    assert tok.convert_tokens_to_ids("😀") == row(241, 160, 153, 129)
    # e + combining acute (CC 81) stays one word and keeps both code points
    assert tok.tokenize("e\u0301t\u00e9") == ["e\u0301t\u00e9"]
    assert tok.convert_tokens_to_ids("e\u0301") == row(102, 205, 130)
    both = tok.convert_tokens_to_ids(["naïve", "😀"])
    assert both == [tok.convert_tokens_to_ids("naïve"), row(241, 160, 153, 129)]


def test_sentence_boundary_words_map_to_boundary_rows(tok):
    assert tok.convert_tokens_to_ids("<S>") == row(257)
    assert tok.convert_tokens_to_ids("</S>") == row(258)
    assert tok(["<S>", "x", "</S>"], is_split_into_words=True)["input_ids"] == [row(257), row(121), row(258)]
    assert tok.convert_ids_to_tokens([row(257), row(258)]) == ["<S>", "</S>"]


def test_word_over_48_bytes_is_cut_inside_a_two_byte_character(tok):
    word = "a" + "é" * 29 + "b"  # 1 + 58 + 1 = 60 bytes
    assert len(word.encode("utf-8")) == 60
    ids = tok.convert_tokens_to_ids(word)
    # exactly the first 48 bytes: "a", 23 times C3 A9, then the lone lead byte C3
    assert ids == [259, 98] + [0xC3 + 1, 0xA9 + 1] * 23 + [0xC3 + 1] + [260]
    assert len(ids) == 50
    assert tok.decode(tok([word], is_split_into_words=True)["input_ids"]) == "a" + "é" * 23 + "\ufffd"


def test_the_first_cut_word_is_logged_once_per_tokenizer(caplog):
    tokenizer = ElmoTokenizer()
    caplog.set_level("WARNING", logger="hf_elmo.tokenization_elmo")
    exactly_48 = "我爱北京天安门我爱北京天安门我爱"  # 16 characters of 3 bytes: the row holds all of it
    tokenizer([exactly_48, "a" * 12, "b" * 49 + " c"])
    assert [r.getMessage() for r in caplog.records] == [
        f"ElmoTokenizer: the model reads a word as its first 48 UTF-8 bytes, as bilm-tf does, and sees nothing of "
        f"the rest of {'b' * 40 + '...'!r} (49 bytes). Longer words are not reported again."]
    tokenizer(["我爱北京天安门" * 3], is_split_into_words=True)  # 63 bytes, after the first: not said again
    assert len(caplog.records) == 1
    ElmoTokenizer(max_characters_per_token=6).convert_tokens_to_ids("abcde")  # a row of 4 bytes: a new tokenizer
    assert caplog.records[-1].getMessage().startswith("ElmoTokenizer: the model reads a word as its first 4 UTF-8")
    assert "'abcde' (5 bytes)" in caplog.records[-1].getMessage()


def test_lone_surrogates_do_not_crash(tok):
    enc = tok("a\ud800b and \udfff", return_offsets_mapping=True)
    assert tok.tokenize("a\ud800b and \udfff") == ["a\ud800b", "and", "\udfff"]
    assert enc["input_ids"] == [row(98, 99), row(98, 111, 101), row()]
    assert enc["offset_mapping"] == [(0, 3), (4, 7), (8, 9)]
    assert tok(["\ud83d"], is_split_into_words=True)["input_ids"] == [row()]


def test_other_max_characters_per_token():
    small = ElmoTokenizer(max_characters_per_token=6)
    assert small.convert_tokens_to_ids("abcdef") == [259, 98, 99, 100, 101, 260]
    assert small("ab", return_tensors="pt")["input_ids"].shape == (1, 1, 6)
    with pytest.raises(ValueError, match="max_characters_per_token"):
        ElmoTokenizer(max_characters_per_token=2)


# ---------------------------------------------------------------------------------------------
# Words and offsets
# ---------------------------------------------------------------------------------------------
def test_offsets_of_raw_text(tok):
    text = "Hello, world!"
    enc = tok(text, return_offsets_mapping=True)
    assert tok.tokenize(text) == ["Hello", ",", "world", "!"]
    assert enc["offset_mapping"] == [(0, 5), (5, 6), (7, 12), (12, 13)]
    assert [text[s:e] for s, e in enc["offset_mapping"]] == ["Hello", ",", "world", "!"]
    assert enc.word_ids() == [0, 1, 2, 3]
    assert enc.tokens() == ["Hello", ",", "world", "!"]
    assert tuple(enc.word_to_chars(2)) == (7, 12)
    assert enc.char_to_word(8) == 2
    assert enc.char_to_word(6) is None  # the space
    assert tuple(enc.word_to_tokens(1)) == (1, 2)
    batch = tok([text, "Hi"], padding=True, return_offsets_mapping=True, return_tensors="pt")
    assert batch["offset_mapping"].shape == (2, 4, 2)
    assert batch["offset_mapping"][1].tolist() == [[0, 2], [0, 0], [0, 0], [0, 0]]


def test_offsets_with_non_bmp_characters(tok):
    text = "😀 naïve 日本語!"
    enc = tok(text, return_offsets_mapping=True)
    assert [text[s:e] for s, e in enc["offset_mapping"]] == ["😀", "naïve", "日本語", "!"]


def test_default_splitter_is_ptb_like_and_cased(tok):
    words = tok.tokenize("I don't know... it's $3.50 in the U.S. e-mail, CAN'T won’t")
    assert words == [
        "I", "do", "n't", "know", "...", "it", "'s", "$", "3.50", "in", "the", "U.S.", "e-mail", ",",
        "CA", "N'T", "wo", "n’t",
    ]  # fmt: skip
    assert tok.tokenize("The CAT") == ["The", "CAT"]


def test_other_splitters():
    text = "don't stop... (ok)"
    assert ElmoTokenizer(pre_tokenizer="bert").tokenize(text) == [
        "don", "'", "t", "stop", ".", ".", ".", "(", "ok", ")",
    ]  # fmt: skip
    assert ElmoTokenizer(pre_tokenizer="whitespace").tokenize(text) == ["don't", "stop...", "(ok)"]
    with pytest.raises(ValueError, match="pre_tokenizer"):
        ElmoTokenizer(pre_tokenizer="moses")


def test_pre_split_words_are_kept_whole_with_fast_tokenizer_offsets(tok):
    enc = tok(
        [["New York", "is", ""], ["big"]],
        is_split_into_words=True,
        padding=True,
        return_offsets_mapping=True,
    )
    assert enc["input_ids"][0][0] == tok.convert_tokens_to_ids("New York")
    assert enc["input_ids"][0][2] == row()  # an empty word is a word with no bytes, not padding
    assert enc["attention_mask"] == [[1, 1, 1], [1, 0, 0]]
    assert enc["offset_mapping"] == [[(0, 8), (0, 2), (0, 0)], [(0, 3), (0, 0), (0, 0)]]
    assert enc.word_ids(0) == [0, 1, 2]
    assert enc.word_ids(1) == [0, None, None]
    assert enc.tokens(1) == ["big", "<pad>", "<pad>"]
    assert tok([], is_split_into_words=True, return_tensors="pt")["input_ids"].shape == (1, 0, 50)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_empty_string_gives_zero_words(tok):
    enc = tok("")
    assert enc["input_ids"] == [] and enc["attention_mask"] == [] and enc.word_ids() == []
    pt = tok("", return_tensors="pt")
    assert pt["input_ids"].shape == (1, 0, 50) and pt["input_ids"].dtype == torch.int64
    assert pt["attention_mask"].shape == (1, 0)
    assert tok("", return_tensors="np")["input_ids"].shape == (1, 0, 50)
    assert tok(["", "  "], padding=True, return_tensors="pt")["input_ids"].shape == (2, 0, 50)
    batch = tok(["", "a b"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape == (2, 2, 50)
    assert batch["input_ids"][0].abs().sum() == 0
    assert batch["attention_mask"].tolist() == [[0, 0], [1, 1]]
    assert batch.word_ids(0) == [None, None]


def test_empty_batch_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="empty batch"):
        tok([])
    with pytest.raises(ValueError, match="empty batch"):
        tok.pad([])


def test_non_str_words_name_their_position(tok):
    with pytest.raises(TypeError, match=r"text\[1\] is a int"):
        tok(["fine", 3])
    with pytest.raises(TypeError, match=r"is_split_into_words=True"):
        tok(["fine", ["a"]])
    with pytest.raises(TypeError, match=r"text\[2\] is a NoneType"):
        tok(["a", "b", None], is_split_into_words=True)
    with pytest.raises(TypeError, match=r"text\[1\]\[0\] is a bytes"):
        tok([["a"], [b"b"]], is_split_into_words=True)
    with pytest.raises(TypeError, match=r"text\[1\] is a str"):
        tok([["a"], "b"], is_split_into_words=True)
    with pytest.raises(TypeError, match="list of words"):
        tok("a b", is_split_into_words=True)
    with pytest.raises(TypeError):
        tok.convert_tokens_to_ids(["a", 1])


def test_sentence_pairs_and_added_tokens_are_refused(tok):
    with pytest.raises(ValueError, match="pairs"):
        tok("a", "b")
    with pytest.raises(ValueError, match="cannot add tokens"):
        tok.add_tokens(["newword"])


# ---------------------------------------------------------------------------------------------
# Padding, truncation, masks
# ---------------------------------------------------------------------------------------------
def test_padding_longest_gives_zero_rows(tok):
    enc = tok(["a b c", "d"], padding=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 3, 50)
    assert enc["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert enc["input_ids"][1, 0].tolist() == row(101)
    assert torch.all(enc["input_ids"][1, 1:] == 0)
    assert enc.word_ids(1) == [0, None, None]
    lists = tok(["a b c", "d"], padding="longest")
    assert lists["input_ids"][1][1:] == [[0] * 50, [0] * 50]


def test_padding_max_length_and_multiple(tok):
    enc = tok(["a b", "c"], padding="max_length", max_length=5, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 5, 50)
    assert enc["attention_mask"].sum(1).tolist() == [2, 1]
    enc = tok(["a b c"], padding=True, pad_to_multiple_of=4, return_tensors="pt")
    assert enc["input_ids"].shape == (1, 4, 50)
    single = tok("a", padding="max_length", max_length=3)
    assert single["input_ids"] == [row(98), [0] * 50, [0] * 50]
    assert single["attention_mask"] == [1, 0, 0]


def test_unpadded_ragged_batch_to_tensors_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="padding=True"):
        tok(["a b", "c"], return_tensors="pt")


def test_truncation_counts_words(tok):
    enc = tok(["one two three four", "five"], truncation=True, max_length=2, padding=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 2, 50)
    assert tok.batch_decode(enc["input_ids"]) == ["one two", "five"]
    words = ["w0", "w1", "w2", "w3"]
    right = tok(words, is_split_into_words=True, truncation=True, max_length=3, return_offsets_mapping=True)
    assert tok.decode(right["input_ids"]) == "w0 w1 w2" and right.word_ids() == [0, 1, 2]
    left_tok = ElmoTokenizer(truncation_side="left")
    left = left_tok(words, is_split_into_words=True, truncation=True, max_length=2)
    assert left_tok.decode(left["input_ids"]) == "w2 w3"
    assert left.word_ids() == [2, 3]


def test_left_padding_is_refused():
    with pytest.raises(ValueError, match="right only"):
        ElmoTokenizer(padding_side="left")
    tok = ElmoTokenizer()
    with pytest.raises(ValueError, match="right only"):
        tok(["a b", "c"], padding=True, padding_side="left")
    tok.padding_side = "left"
    with pytest.raises(ValueError, match="right only"):
        tok(["a b", "c"], padding=True)
    with pytest.raises(ValueError, match="right only"):
        tok.pad([{"input_ids": [row(98)]}, {"input_ids": [row(98), row(99)]}])


def test_masks_lengths_and_no_special_tokens(tok):
    enc = tok(
        ["a b c", "d"],
        padding=True,
        return_special_tokens_mask=True,
        return_length=True,
        return_token_type_ids=True,
        add_special_tokens=True,
    )
    assert enc["special_tokens_mask"] == [[0, 0, 0], [0, 1, 1]]
    assert enc["length"] == [3, 1]
    assert enc["token_type_ids"] == [[0, 0, 0], [0, 0, 0]]
    assert tok("a b", add_special_tokens=False)["input_ids"] == tok("a b", add_special_tokens=True)["input_ids"]
    no_mask = tok(["a b", "c"], padding=True, return_attention_mask=False)
    assert "attention_mask" not in no_mask
    assert set(tok("a")) == {"input_ids", "attention_mask"}
    assert tok.num_special_tokens_to_add() == 0


def test_pad_token_and_vocab(tok):
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.all_special_ids == [0]
    assert tok.vocab_size == 262 and len(tok) == 262
    vocab = tok.get_vocab()
    assert len(vocab) == 262 and sorted(vocab.values()) == list(range(262))
    assert vocab["<pad>"] == 0 and vocab["<0x00>"] == 1 and vocab["<0x61>"] == 98
    assert vocab["<begin_sentence>"] == 257 and vocab["<end_sentence>"] == 258
    assert vocab["<begin_word>"] == 259 and vocab["<end_word>"] == 260 and vocab["<char_pad>"] == 261
    assert tok.convert_ids_to_tokens(98) == "<0x61>" and tok.convert_ids_to_tokens(0) == "<pad>"
    assert tok.convert_tokens_to_ids("<pad>") == 0
    assert tok.convert_tokens_to_ids(["a", "<pad>"]) == [row(98), [0] * 50]


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------
def test_decode_round_trip(tok):
    text = "ELMo reads naïve 日本語 words, even 😀!"
    words = tok.tokenize(text)
    enc = tok([text, "short"], padding=True, return_tensors="pt")
    assert tok.decode(enc["input_ids"][0]) == " ".join(words)
    assert tok.decode(enc["input_ids"][1]) == "short"  # padding rows skipped
    assert tok.decode(enc["input_ids"]) == [" ".join(words), "short"]
    assert tok.batch_decode(enc["input_ids"]) == [" ".join(words), "short"]
    assert tok.batch_decode(enc["input_ids"].tolist()) == [" ".join(words), "short"]
    assert tok.decode(enc["input_ids"][0, 1]) == "reads"
    assert tok.convert_ids_to_tokens(enc["input_ids"][1].tolist()) == ["short"] + ["<pad>"] * (len(words) - 1)
    assert tok.convert_ids_to_tokens(enc["input_ids"][1], skip_special_tokens=True) == ["short"]
    assert tok.convert_ids_to_tokens(row(98)) == "a"
    assert tok.decode([]) == ""


# ---------------------------------------------------------------------------------------------
# pad() and the stock data collators
# ---------------------------------------------------------------------------------------------
def features(tok):
    sentences = [["EU", "rejects", "German", "call"], ["Peter"], ["to", "boycott", "British"]]
    labels = [[3, 0, 7, 0], [1], [0, 0, 7]]
    out = []
    for words, tags in zip(sentences, labels):
        enc = tok(words, is_split_into_words=True)
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": tags})
    return out


def test_data_collator_for_token_classification(tok):
    batch = DataCollatorForTokenClassification(tok)(features(tok))
    assert batch["input_ids"].shape == (3, 4, 50) and batch["input_ids"].dtype == torch.int64
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[3, 0, 7, 0], [1, -100, -100, -100], [0, 0, 7, -100]]
    assert torch.all(batch["input_ids"][1, 1:] == 0) and torch.all(batch["input_ids"][2, 3] == 0)
    assert batch["input_ids"][1, 0].tolist() == tok.convert_tokens_to_ids("Peter")
    assert batch.word_ids(2) == [0, 1, 2, None]
    multiple = DataCollatorForTokenClassification(tok, pad_to_multiple_of=8)(features(tok))
    assert multiple["input_ids"].shape == (3, 8, 50) and multiple["labels"].shape == (3, 8)
    as_np = DataCollatorForTokenClassification(tok, return_tensors="np")(features(tok))
    assert isinstance(as_np["input_ids"], np.ndarray) and as_np["input_ids"].shape == (3, 4, 50)


def test_data_collator_with_padding(tok):
    feats = [
        {"input_ids": f["input_ids"], "attention_mask": f["attention_mask"], "label": i % 2}
        for i, f in enumerate(features(tok))
    ]
    batch = DataCollatorWithPadding(tok)(feats)
    assert batch["input_ids"].shape == (3, 4, 50)
    assert batch["attention_mask"].sum(1).tolist() == [4, 1, 3]
    assert batch["labels"].tolist() == [0, 1, 0]
    assert "label" not in batch
    no_mask = [{"input_ids": f["input_ids"]} for f in features(tok)]
    batch = DataCollatorWithPadding(tok, padding="max_length", max_length=6)(no_mask)
    assert batch["input_ids"].shape == (3, 6, 50)
    assert batch["attention_mask"].tolist()[1] == [1, 0, 0, 0, 0, 0]


def test_pad_accepts_tensors_batch_encodings_and_keeps_alignment(tok):
    feats = [{"input_ids": torch.tensor(f["input_ids"])} for f in features(tok)]
    batch = tok.pad(feats)  # tensors in, tensors out
    assert isinstance(batch["input_ids"], torch.Tensor) and batch["input_ids"].shape == (3, 4, 50)
    assert batch.word_ids(1) == [0, None, None, None]
    with pytest.raises(ValueError, match="convert_ids_to_tokens"):
        batch.tokens(1)  # built from ids alone: the words are not kept
    encoded = tok(["a b c", "d", ""])
    padded = tok.pad(encoded, return_tensors="pt")
    assert padded["input_ids"].shape == (3, 3, 50)
    assert padded.word_ids(1) == [0, None, None] and padded.word_ids(2) == [None, None, None]
    left_tok = ElmoTokenizer(truncation_side="left")
    kept = left_tok(["w0 w1 w2", "w3"], truncation=True, max_length=2, return_offsets_mapping=True)
    repadded = left_tok.pad(kept)
    assert repadded.word_ids(0) == [1, 2] and repadded.word_ids(1) == [0, None]
    assert tuple(repadded.word_to_chars(0, 2)) == (6, 8)
    assert repadded.tokens(1) == ["w3", "<pad>"]
    single = tok.pad({"input_ids": [row(98)]}, padding="max_length", max_length=2)
    assert single["input_ids"] == [row(98), [0] * 50] and single["attention_mask"] == [1, 0]


# ---------------------------------------------------------------------------------------------
# Saving, loading, word vocabulary
# ---------------------------------------------------------------------------------------------
def write_vocab(path, words):
    path.write_text("".join(w + "\n" for w in words), encoding="utf-8")
    return str(path)


def test_save_and_load_without_vocab(tmp_path):
    tok = ElmoTokenizer(max_characters_per_token=20, pre_tokenizer="bert")
    tok.save_pretrained(tmp_path)
    assert not (tmp_path / "vocab.txt").exists()
    loaded = ElmoTokenizer.from_pretrained(tmp_path)
    assert loaded.max_characters_per_token == 20 and loaded.pre_tokenizer == "bert"
    assert loaded.word_vocab is None and loaded.pad_token_id == 0
    assert loaded("don't", return_tensors="pt")["input_ids"].shape == (1, 3, 20)
    assert loaded("naïve")["input_ids"] == tok("naïve")["input_ids"]


def test_save_and_load_with_vocab(tmp_path):
    vocab = write_vocab(tmp_path / "bilm_vocab.txt", ["<S>", "</S>", "<UNK>", "the", ",", "naïve", "日本語"])
    tok = ElmoTokenizer(vocab_file=vocab)
    assert tok.word_vocab == ["<S>", "</S>", "<UNK>", "the", ",", "naïve", "日本語"]
    assert tok.word_vocab_size == 7
    assert tok.word_to_index("the") == 3 and tok.word_to_index("never-seen") == 2
    assert tok.words_to_indices(["<S>", "naïve", "The", "</S>"]) == [0, 5, 2, 1]
    assert tok.words_to_indices([["the"], ["日本語", ","]]) == [[3], [6, 4]]
    assert (tok.bos_word_index, tok.eos_word_index, tok.unk_word_index) == (0, 1, 2)
    assert tok.index_to_word(5) == "naïve"
    saved = tmp_path / "saved"
    tok.save_pretrained(saved)
    assert (saved / "vocab.txt").read_text(encoding="utf-8").splitlines() == tok.word_vocab
    loaded = ElmoTokenizer.from_pretrained(saved)
    assert loaded.word_vocab == tok.word_vocab and loaded.word_to_index("naïve") == 5
    assert loaded.max_characters_per_token == 50


def test_vocab_without_tokenizer_vocab_has_clear_errors(tmp_path):
    tok = ElmoTokenizer()
    with pytest.raises(ValueError, match="no word vocabulary"):
        tok.word_to_index("the")


def test_missing_vocab_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "vocab.txt"
    with pytest.raises(FileNotFoundError, match="nope"):
        ElmoTokenizer(vocab_file=str(missing))


def test_vocab_lacking_boundary_words_says_which(tmp_path):
    vocab = write_vocab(tmp_path / "v.txt", ["<S>", "the", "a"])
    with pytest.raises(ValueError) as raised:
        ElmoTokenizer(vocab_file=vocab)
    # Present is enough, as bilm-tf's own fixture vocabulary shows: the message does not ask for them first.
    assert str(raised.value) == (f"ElmoTokenizer: the vocabulary file {vocab!r} lacks the required entries ['</S>', "
                                 "'<UNK>']. A bilm-tf vocabulary lists one word per line, frequency sorted, with <S>, "
                                 "</S> and <UNK> among them.")
    bilm = write_vocab(tmp_path / "m.txt", ["!!!MAXTERMID", "<S>", "</S>", "<UNK>", "the"])
    assert ElmoTokenizer(vocab_file=bilm).word_vocab == ["<S>", "</S>", "<UNK>", "the"]


def test_one_set_of_vocabulary_rules_for_tokenizer_and_converter(tmp_path):
    from hf_elmo import bilm_tf
    from hf_elmo.tokenization_elmo import read_vocab

    path = tmp_path / "vocab.txt"
    path.write_bytes("\ufeff!!!MAXTERMID\n<S>\n </S> \n<UNK>\r\nthe\n".encode("utf-8"))
    expected = ["<S>", "</S>", "<UNK>", "the"]
    assert read_vocab(path) == expected
    assert bilm_tf.read_vocab(str(path)) == expected
    assert ElmoTokenizer(vocab_file=path).word_vocab == expected


@pytest.mark.parametrize("style", ["ptb", "bert", "whitespace"])
def test_invisible_format_characters_separate_or_vanish_in_raw_text(style):
    tokenizer = ElmoTokenizer(pre_tokenizer=style)
    # A zero-width space separates words; a byte-order mark, word joiner, soft hyphen or direction mark is dropped
    # (and is no word by itself); ZWJ and ZWNJ stay inside their word, and alone are no word. Offsets still point
    # into the input.
    cases = {
        "Hello\u200bworld": (["Hello", "world"], [(0, 5), (6, 11)]),
        "Hello \ufeff world": (["Hello", "world"], [(0, 5), (8, 13)]),
        "\ufeffStart now": (["Start", "now"], [(0, 6), (7, 10)]),
        "co\u00adoperate": (["cooperate"], [(0, 10)]),
        "x\u2060y \u200e": (["xy"], [(0, 3)]),
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645": (["\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"], [(0, 8)]),
        "\U0001f469\u200d\U0001f4bb": (["\U0001f469\u200d\U0001f4bb"], [(0, 3)]),
        "\u0d28\u0d4d\u200d": (["\u0d28\u0d4d\u200d"], [(0, 3)]),
        # A ZWNJ or ZWJ with nothing to join (after a zero-width space, or alone) is no word: it was an invisible one.
        "Hello\u200b\u200c world": (["Hello", "world"], [(0, 5), (8, 13)]),
        "x \u200d y": (["x", "y"], [(0, 1), (4, 5)]),
    }
    for text, (words, spans) in cases.items():
        assert tokenizer.tokenize(text) == words, (style, text)
        assert [tuple(s) for s in tokenizer(text, return_offsets_mapping=True)["offset_mapping"]] == spans, text
    # Words given already split are taken as they are.
    given = tokenizer([["Hello\u200bworld"]], is_split_into_words=True)["input_ids"][0][0]
    assert given == tokenizer._char_row("Hello\u200bworld")
    assert char_ids_to_word(given) == "Hello\u200bworld"


def test_scripts_without_spaces_are_not_segmented_as_the_readme_says():
    # README "Scripts written without spaces": no pre-tokenizer segments them, and a word is read as 48 bytes.
    from hf_elmo import ElmoTokenizer

    expected = {"ptb": ["我爱北京天安门", "。"], "bert": ["我爱北京天安门", "。"], "whitespace": ["我爱北京天安门。"]}
    for style, words in expected.items():
        tokenizer = ElmoTokenizer(pre_tokenizer=style)
        assert tokenizer.tokenize("我爱北京天安门。") == words
        assert tokenizer.tokenize("ฉันรักภาษาไทยมาก") == ["ฉันรักภาษาไทยมาก"]
    tokenizer = ElmoTokenizer()
    long_word = "我爱北京天安门" * 3  # 21 characters, 63 bytes
    ids = [tokenizer([text])["input_ids"] for text in (long_word, long_word[:16], long_word[:15])]
    assert ids[0] == ids[1] != ids[2] and len(long_word[:16].encode("utf-8")) == 48
