"""ppsim.calibrate.execute.launch under torchrun: a peer rank that is gone is one line naming it, not a traceback."""

from __future__ import annotations

import pytest

from ppsim.calibrate.execute.launch import peer_lost_line, peers_lost_in_one_line
from ppsim.errors import RankLostError

#: What a surviving rank of a 2-node gloo run raised when a rank on the other node was killed (SIGABRT), verbatim.
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[10.77.0.2]:5764. This is typically caused by a remote worker crashing. Check the logs of the "
                    "remote worker before reporting an error. GLHF!")


def test_a_closed_connection_to_a_peer_is_one_line_naming_its_address() -> None:
    with pytest.raises(RankLostError) as err:
        with peers_lost_in_one_line(1, 4, "the run"):
            raise RuntimeError(GLOO_PEER_CLOSED)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("the run: rank 1 of 4 stopped: connection closed by peer (a rank at 10.77.0.2)")
    assert "log" in text and "pair.cc" not in text


@pytest.mark.parametrize("message", ["Connection reset by peer", "NCCL communicator was aborted on rank 3"])
def test_other_backends_words_for_a_lost_peer_are_recognised(message: str) -> None:
    assert peer_lost_line(RuntimeError(message)) is not None


def test_any_other_error_passes_through_unchanged() -> None:
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with peers_lost_in_one_line(0, 2, "the run"):
            raise RuntimeError("shape mismatch in stage 1")
    with pytest.raises(ValueError):
        with peers_lost_in_one_line(0, 2, "the run"):
            raise ValueError(GLOO_PEER_CLOSED)  # not a backend's error
