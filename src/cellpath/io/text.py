"""Text files a user writes or edits (manifests, the download lock, params.yaml) read as UTF-8, with one
clear error for any other encoding instead of a bare ``UnicodeDecodeError``.

A spreadsheet that saves "CSV" in Latin-1 or Windows-1252 writes ``é`` as the single byte 0xe9; read as
UTF-8 that is an error, and read as anything else it would silently become another character. A UTF-8
byte-order mark (Excel's "CSV UTF-8") is dropped, so the first column keeps its name.
"""

from __future__ import annotations

from pathlib import Path

from cellpath.errors import InputError


class NotUtf8(InputError):
    """A text file that is not UTF-8: the message names the file, the byte and its line."""


def read_utf8(path: Path) -> str:
    """The file's text (a leading byte-order mark dropped); :class:`NotUtf8` when it is not UTF-8."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise NotUtf8(f"not UTF-8 text: byte 0x{data[exc.start]:02x} on line {line} ({exc.reason}); save it as "
                      f"UTF-8, e.g. `iconv -f latin1 -t utf-8 {Path(path).name} > fixed.csv` for a Latin-1 file",
                      path=path) from None
