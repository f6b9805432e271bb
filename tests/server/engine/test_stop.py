"""The stop rule: token_stop, find_stop and held_back."""

import pytest

from server.engine.stop import LENGTH, STOP, find_stop, held_back, token_stop
from server.sampling_params import SamplingParams

EOS = 0


def stop_of(tok, num_output=1, num_tokens=10, max_model_len=100, eos=EOS, **params):
    eos_ids = frozenset() if eos is None else frozenset(eos if isinstance(eos, (list, set, frozenset)) else [eos])
    return token_stop(tok, num_output, num_tokens, SamplingParams(**params), eos_ids, max_model_len)


def test_eos_stops_unless_ignored():
    assert stop_of(EOS) == STOP
    assert stop_of(EOS, ignore_eos=True) is None
    assert stop_of(5) is None
    assert stop_of(EOS, eos=None) is None  # a tokenizer without an end-of-sequence token


def test_every_eos_id_of_the_model_stops():
    # Llama 3 lists several (generation_config.json): <|end_of_text|>, <|eom_id|>, <|eot_id|>
    for tok in (128001, 128008, 128009):
        assert stop_of(tok, eos=[128001, 128008, 128009]) == STOP
    assert stop_of(128000, eos=[128001, 128008, 128009]) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    assert stop_of(42, stop_token_ids=[7, 42], ignore_eos=True) == STOP
    assert stop_of(43, stop_token_ids=[7, 42]) is None


def test_max_tokens_and_context_limit_give_length():
    assert stop_of(5, num_output=3, max_tokens=4) is None
    assert stop_of(5, num_output=4, max_tokens=4) == LENGTH
    assert stop_of(5, num_tokens=99, max_model_len=100) is None
    assert stop_of(5, num_tokens=100, max_model_len=100) == LENGTH


def test_a_stop_token_at_the_length_limit_reports_stop():
    assert stop_of(EOS, num_output=4, max_tokens=4) == STOP
    assert stop_of(9, num_tokens=100, max_model_len=100, stop_token_ids=[9]) == STOP


@pytest.mark.parametrize("stops", [["ef", "def"], ["def", "ef"]])
def test_find_stop_returns_the_earliest_of_several(stops):
    assert find_stop("abcdef", 2, stops) == 3


def test_find_stop_spans_the_boundary_with_the_newest_piece():
    assert find_stop("hello wor" + "ld", 2, ["world"]) == 6
    assert find_stop("hello world", 11, ["world"]) == 6


def test_find_stop_ignores_stops_the_newest_piece_could_not_complete():
    # "END" lies wholly before the newest piece "yy": an earlier step would have found it.
    assert find_stop("xxENDyy", 2, ["END"]) is None
    assert find_stop("xxENDyy", 3, ["END"]) == 2
    assert find_stop("xxENDyy", 2, ["ND", "Dy"]) == 4
    assert find_stop("abc", 3, []) is None


def test_held_back_is_the_longest_stop_minus_one_until_finished():
    assert held_back(SamplingParams(), finished=False) == 0
    assert held_back(SamplingParams(stop=["ab", "wxyz"]), finished=False) == 3
    assert held_back(SamplingParams(stop=["ab", "wxyz"]), finished=True) == 0


def stream(pieces, stops, finish_reason_last=None):
    """Pieces through the stop rule as LLMEngine._advance applies it: (streamed chunks, final text,
    stopped)."""
    params = SamplingParams(stop=stops)
    text, emitted, sent = "", 0, []
    for k, piece in enumerate(pieces):
        finished = finish_reason_last is not None and k == len(pieces) - 1
        text += piece
        cut = find_stop(text, len(piece), stops)
        if cut is not None:
            text, finished = text[:cut], True
        end = max(emitted, len(text) - held_back(params, finished))
        sent.append(text[emitted:end])
        emitted = end
        if finished:
            return sent, text, cut is not None
    return sent, text, False


def test_streamed_text_never_holds_what_a_stop_string_cuts():
    sent, text, stopped = stream(["Hel", "lo ST", "O", "P now"], ["STOP"])
    assert stopped and text == "Hello "
    assert sent == ["", "Hello", " ", ""]  # "S", "ST", "STO" were held back, then cut


def test_held_back_text_is_released_when_the_stop_string_does_not_complete():
    sent, text, stopped = stream(["ab S", "TO", "x y"], ["STOP"])
    assert not stopped and text == "ab STOx y"
    assert "".join(sent) == "ab STO"  # the last three characters could still start "STOP"
    sent, text, stopped = stream(["ab S", "TO", "x y"], ["STOP"], finish_reason_last=LENGTH)
    assert not stopped and "".join(sent) == "ab STOx y"


def test_earliest_stop_wins_when_one_piece_completes_two():
    sent, text, stopped = stream(["say: ", "foo bar!"], ["bar", "oo"])
    assert stopped and text == "say: f" and "".join(sent) == "say: f"
