"""Text files must be UTF-8: one wording, for every reader of lines (embed, pretraining, fine-tuning data, the AllenNLP
drop-in), of a line that is not, with the command that converts the file."""

from __future__ import annotations

import codecs


# Byte-order marks of encodings other than UTF-8, UTF-32's first: UTF-16's are their prefixes. Such a mark at the start
# of a file says what the file is, which is more use than the first byte that is not UTF-8.
FOREIGN_BYTE_ORDER_MARKS = {codecs.BOM_UTF32_LE: "UTF-32", codecs.BOM_UTF32_BE: "UTF-32",
                            codecs.BOM_UTF16_LE: "UTF-16", codecs.BOM_UTF16_BE: "UTF-16"}


CONVERT_LATIN1 = "expected UTF-8. Convert the file, e.g. iconv -f LATIN1 -t UTF-8 for Latin-1."


def foreign_encoding(head: bytes) -> str | None:
    """"UTF-16" or "UTF-32" where `head`, the start of a file, begins with that encoding's byte-order mark."""
    return next((encoding for mark, encoding in FOREIGN_BYTE_ORDER_MARKS.items() if head.startswith(mark)), None)


def not_utf8_message(path: str, where: str, raw: bytes, error: UnicodeDecodeError) -> str:
    """
    The one line for a line of `path` that is not UTF-8: `where` names the line in the reader's own style ("FILE,
    line 3" or "FILE:3"), `raw` is its bytes and `error` what decoding them raised. A line that starts with a UTF-16 or
    UTF-32 byte-order mark (the first line of such a file) names that encoding instead.
    """
    encoding = foreign_encoding(raw)
    if encoding is not None:
        return (f"{path}: the file is {encoding} (it starts with a {encoding} byte-order mark); expected UTF-8. "
                f"Convert it: iconv -f {encoding} -t UTF-8 {path} > NEW_FILE")
    return f"{where}: not UTF-8 text (byte {error.start}: {raw[error.start:error.start + 4]!r}); {CONVERT_LATIN1}"


def first_line_not_utf8(path: str) -> str | None:
    """
    `not_utf8_message` for the first line of `path` that is not UTF-8, or None if there is none: for a reader that
    decodes a whole file at once (the vocabulary's, in the saved folder's code) and learns only that it failed.
    """
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return not_utf8_message(path, f"{path}, line {number}", raw, error)
    return None
