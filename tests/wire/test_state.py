"""The join exchange's messages (wire/state.py): each binds both nonces, so bytes of
one join verify in no other; every byte is under a MAC; bad layouts are named."""

from __future__ import annotations

import pytest

from flodl_trio.errors import HandshakeError, MacError
from flodl_trio.wire.salt import SessionSalt
from flodl_trio.wire.state import (
    STATE_ANSWER_LEN,
    STATE_CHALLENGE_LEN,
    STATE_ENTRY_LEN,
    STATE_RECEIPT_LEN,
    STATE_REQUEST_LEN,
    EntryStatus,
    JoinNonces,
    StateEntry,
    StateReply,
    StateStatus,
    check_state_answer,
    check_state_receipt,
    decode_state_challenge,
    decode_state_entry,
    decode_state_reply,
    decode_state_request,
    encode_state_answer,
    encode_state_challenge,
    encode_state_entry,
    encode_state_receipt,
    encode_state_reply,
    encode_state_request,
    new_nonce,
)

SALT = SessionSalt(b"\x42" * 16)
OTHER = SessionSalt(b"\x17" * 16)


def _nonces() -> JoinNonces:
    return JoinNonces(new_nonce(), new_nonce())


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def test_the_exchange_round_trips_with_the_documented_sizes() -> None:
    rank_nonce = new_nonce()
    request = encode_state_request(1, 3, rank_nonce, SALT)
    assert len(request) == STATE_REQUEST_LEN == 40
    assert decode_state_request(request, 3, SALT).nonce == rank_nonce
    nonces = JoinNonces(rank_nonce, new_nonce())
    challenge = encode_state_challenge(nonces, SALT)
    assert len(challenge) == STATE_CHALLENGE_LEN == 32
    assert decode_state_challenge(challenge, rank_nonce, SALT) == nonces
    answer = encode_state_answer(1, nonces, SALT)
    assert len(answer) == STATE_ANSWER_LEN == 16
    check_state_answer(answer, 1, nonces, SALT)
    receipt = encode_state_receipt(nonces, SALT)
    assert len(receipt) == STATE_RECEIPT_LEN == 16
    check_state_receipt(receipt, 1, nonces, SALT)
    entry = encode_state_entry(StateEntry(EntryStatus.ENTERED, 7), nonces, SALT)
    assert len(entry) == STATE_ENTRY_LEN == 28
    assert decode_state_entry(entry, nonces, SALT) == StateEntry(EntryStatus.ENTERED, 7)


def test_an_answer_recorded_in_one_join_does_not_verify_in_the_next() -> None:
    """The replay of issue 29: the same request bytes, a new challenge; the old answer fails."""
    rank_nonce = new_nonce()
    first = JoinNonces(rank_nonce, new_nonce())
    recorded = encode_state_answer(1, first, SALT)
    replayed_into = JoinNonces(rank_nonce, new_nonce())  # the controller's nonce is fresh each time
    with pytest.raises(MacError, match="state answer from rank 1"):
        check_state_answer(recorded, 1, replayed_into, SALT)


def test_an_answer_is_bound_to_its_rank_and_to_the_salt() -> None:
    nonces = _nonces()
    with pytest.raises(MacError):
        check_state_answer(encode_state_answer(2, nonces, SALT), 1, nonces, SALT)
    with pytest.raises(MacError):
        check_state_answer(encode_state_answer(1, nonces, OTHER), 1, nonces, SALT)


def test_a_challenge_for_another_request_or_from_another_salt_is_refused() -> None:
    nonces = _nonces()
    challenge = encode_state_challenge(nonces, SALT)
    with pytest.raises(MacError, match="state challenge"):
        decode_state_challenge(challenge, new_nonce(), SALT)
    with pytest.raises(MacError):
        decode_state_challenge(encode_state_challenge(nonces, OTHER), nonces.rank, SALT)


@pytest.mark.parametrize("at", range(STATE_CHALLENGE_LEN))
def test_every_byte_of_the_challenge_is_checked(at: int) -> None:
    nonces = _nonces()
    with pytest.raises((MacError, HandshakeError)):
        decode_state_challenge(_flip(encode_state_challenge(nonces, SALT), at), nonces.rank, SALT)


@pytest.mark.parametrize("at", range(STATE_ENTRY_LEN))
def test_every_byte_of_the_entry_is_checked(at: int) -> None:
    nonces = _nonces()
    with pytest.raises((MacError, HandshakeError)):
        decode_state_entry(_flip(encode_state_entry(StateEntry(EntryStatus.ENTERED, 5), nonces, SALT), at), nonces, SALT)


def test_a_reply_is_bound_to_both_nonces() -> None:
    nonces = _nonces()
    reply = StateReply(StateStatus.OK, 4, 1, lengths=(57,))
    raw = encode_state_reply(reply, nonces, SALT)
    assert decode_state_reply(raw[:28], raw[28:], nonces, SALT) == reply
    for other in (JoinNonces(nonces.rank, new_nonce()), JoinNonces(new_nonce(), nonces.controller)):
        with pytest.raises(MacError, match="state reply"):
            decode_state_reply(raw[:28], raw[28:], other, SALT)


def test_a_receipt_of_another_join_is_refused() -> None:
    nonces = _nonces()
    with pytest.raises(MacError, match="state receipt from rank 3"):
        check_state_receipt(encode_state_receipt(_nonces(), SALT), 3, nonces, SALT)


def test_an_entry_says_a_window_only_when_the_rank_entered() -> None:
    nonces = _nonces()
    called_off = encode_state_entry(StateEntry.called_off(), nonces, SALT)
    assert decode_state_entry(called_off, nonces, SALT).status is EntryStatus.CALLED_OFF
    with pytest.raises(HandshakeError, match="status ENTERED with window -1"):
        decode_state_entry(encode_state_entry(StateEntry(EntryStatus.ENTERED, -1), nonces, SALT), nonces, SALT)
    with pytest.raises(HandshakeError, match="unknown status 9"):
        decode_state_entry(encode_state_entry(StateEntry(9, 3), nonces, SALT), nonces, SALT)  # type: ignore[arg-type]


def test_version_1_peers_are_told_about_the_skew() -> None:
    request = bytearray(encode_state_request(0, 2, new_nonce(), SALT))
    request[4] = 1
    with pytest.raises(HandshakeError, match="protocol version 1, this side speaks 2"):
        decode_state_request(bytes(request), 2, SALT)
