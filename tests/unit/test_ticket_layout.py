"""The ticket's layout as written and as coded agree, and the bytes on the wire do not move:
the module note's table against ``ticket.FIELDS`` and ``LAYOUT``, two tickets against their
recorded bytes, and the hand-over frames against ``wire``'s helpers."""

from __future__ import annotations

import re

import pytest
import torch

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq import wire
from blockflow.backend.tensormq.handout import MAC
from blockflow.backend.tensormq.handover import MODEL

KEY = bytes(range(32))
# Two tickets encoded with KEY (a tensor; a record) and their bytes: a change of these is a change of
# the protocol, and of VERSION.
SINGLE = tk.Ticket(0x0123456789ABCDEF, 0x1234, 7, 9, 3, 4096, 48, torch.float16, (2, 3, 4), tk.DEVICE_CUDA, 2, 5,
                   tk.model_id("m"))
RECORD = tk.Ticket(0xFEDCBA9876543210, 1, 1, 2, 0, 64, 40, torch.float32, (10,), tk.DEVICE_HOST, 0, 0, tk.model_id("x"),
                   tk.layout_id([(2, 3), (4,)]))
SINGLE_HEX = (
    "4246545102000000efcdab89674523013412000007000000090000000300000000100000000000003000000000000000"
    "020301020500000002000000030000000400000000000000000000000000000000000000000000000c00000000000000"
    "040000000000000001000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000cdb8f72fe762a30d0000000000000000" + "00" * 72 +
    "060e9576d53e04f7838fc60605a73020")
RECORD_HEX = (
    "42465451020001001032547698badcfe0100000001000000020000000000000040000000000000002800000000000000"
    "01010000000000000a000000000000000000000000000000000000000000000000000000000000000100000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000067594535cd76243d79e6b70be01e4d5e" + "00" * 72 +
    "624f433002ce7b6db17ffdcc2e5e5f16")


def _table() -> dict[str, tuple[int, int, str]]:
    """Field -> (offset, size, what) as the module note's table says."""
    doc = tk.__doc__ or ""
    rows = re.findall(r"^ {4}(\d+) +(\d+) +(\w+) +(.*)$", doc, re.M)
    return {name: (int(at), int(size), what) for at, size, name, what in rows}


def test_the_note_s_table_is_the_coded_layout() -> None:
    table = _table()
    assert list(table) == list(tk.LAYOUT)  # every field, in order, and nothing else
    for name, where in tk.LAYOUT.items():
        assert table[name][:2] == (where.start, where.stop - where.start), name
    assert tk.LAYOUT["mac"].stop == tk.TICKET_BYTES


def test_the_note_s_table_names_the_coded_constants() -> None:
    table = _table()
    assert table["magic"][2] == f'b"{tk.MAGIC.decode()}" (MAGIC)'
    assert table["version"][2] == f"{tk.VERSION} (VERSION)"
    assert table["flags"][2].startswith(f"FLAG_RECORD ({tk.FLAG_RECORD})")
    assert f"1 to {tk.MAX_DIMS} (MAX_DIMS)" in table["ndim"][2]
    assert f"{tk.DEVICE_HOST} host" in table["device_type"][2] and f"{tk.DEVICE_CUDA} CUDA" in table["device_type"][2]
    assert f"{tk.MAX_DIMS} x" in table["shape"][2] and f"{tk.MAX_DIMS} x" in table["strides"][2]


@pytest.mark.parametrize(("t", "raw"), [(SINGLE, SINGLE_HEX), (RECORD, RECORD_HEX)])
def test_tickets_keep_their_bytes(t: tk.Ticket, raw: str) -> None:
    assert tk.encode(t, KEY).hex() == raw
    assert tk.decode(bytes.fromhex(raw), KEY) == t


def test_a_ticket_s_fields_sit_where_the_layout_says() -> None:
    raw = tk.encode(RECORD, KEY)
    assert raw[tk.LAYOUT["version"]] == tk.VERSION.to_bytes(2, "little")
    assert raw[tk.LAYOUT["flags"]] == tk.FLAG_RECORD.to_bytes(2, "little")
    assert raw[MODEL] == tk.model_id("x").to_bytes(8, "little")
    assert raw[MAC] == raw[-tk.MAC_BYTES:] and not any(raw[tk.LAYOUT["reserved"]])


def test_hand_over_frames() -> None:
    key, ticket = tk.encode(SINGLE, KEY)[MAC], tk.encode(RECORD, KEY)
    origin = wire.ORIGIN.pack(4242)
    assert wire.handed(key, ticket) == [key, b"", ticket, wire.NO_ORIGIN]
    assert wire.hand_over_of(wire.handed(key, ticket, origin)) == (key, wire.HANDED, ticket, origin)
    assert wire.failed(key, "x" * 5000) == [key, b"x" * wire.STATUS_MAX, b"", wire.NO_ORIGIN]
    assert wire.failed(key, "") == [key, b"failed", b"", wire.NO_ORIGIN]
    assert wire.hand_over_of(wire.failed(key, "gone", origin)) == (key, b"gone", b"", origin)
    assert wire.hand_over_of([key, wire.HANDED, ticket[:-1], origin]) is None  # a ticket cut short
    assert wire.hand_over_of([key[:-1], wire.HANDED, ticket, origin]) is None  # not a MAC
    assert wire.hand_over_of([key, wire.HANDED, ticket, origin[:-1]]) is None  # no origin
    assert wire.hand_over_of([key, wire.HANDED, ticket]) is None
