"""Asynchronous generation against a vLLM server (`vllm_mode="server"`): TRL's server path, split at its HTTP call.

When a request is sent ahead of time, the prompts are gathered from every process and the main process captures the
HTTP request TRL's client would send (`_ServerRequests.capture`), to send it from the generator thread; when the batch
is scored, TRL's own server path runs (gather, broadcast, parsing, R3's route watcher) and its client's `session.post`
is answered with that response. Weights go through TRL's `sync_weights`, only when no request is in flight. The source
that drives it is async_rollouts.py; the other backends are async_backends.py.
"""

from __future__ import annotations

import functools
from urllib.parse import urlsplit

from ..common import seam, trl_compat
from .pipeline import Completions, GenerationRequest


class _Captured(Exception):
    def __init__(self, url, kwargs):
        super().__init__("captured")
        self.url, self.kwargs = url, kwargs


def _same_request(url: str, body, sent_url: str, sent_body) -> bool:
    """Whether TRL's request now is the one sent ahead of time. The server's address and the served name may differ
    after a resume (a server restarted elsewhere, whose model `check_served_model` has compared): the endpoint and the
    rest of the body may not."""

    def without_model(body):
        return {k: v for k, v in body.items() if k != "model"} if isinstance(body, dict) else body

    return urlsplit(url).path == urlsplit(sent_url).path and without_model(body) == without_model(sent_body)


class _ServerRequests:
    """Wraps the main process's TRL vLLM client `session.post`: capture the request TRL's client would send (to send it
    from the generator thread), and answer TRL's own call with that response when the batch is scored. Other requests
    (weight updates, cache resets, evaluation) pass through."""

    def __init__(self, client):
        self.client = client
        self._capturing, self._answer = False, None
        self.post = seam.replace_session_post(client, self._post)

    def capture(self, call):
        self._capturing = True
        try:
            call()
        except _Captured as captured:
            return captured.url, captured.kwargs
        finally:
            self._capturing = False
        raise RuntimeError("TRL's vLLM client returned without sending a generation request.")

    def send(self, url: str, kwargs: dict, timeout: float) -> dict:
        """Generator thread: the request, as TRL's client would send it; the response as plain values."""
        import requests

        try:
            response = self.post(url, timeout=timeout, **kwargs)
        except requests.exceptions.Timeout as exc:
            raise TimeoutError(f"The vLLM server at {url} did not answer within {timeout:g} s.") from exc
        if response.status_code != 200:
            raise RuntimeError(f"The vLLM server at {url} answered {response.status_code}: {response.text[:2000]}")
        return {"url": url, "json": kwargs.get("json"), "text": response.text}

    def answer(self, result: dict | None):
        self._answer = result

    def _post(self, url, **kwargs):
        if self._capturing:
            raise _Captured(url, kwargs)
        answer, self._answer = self._answer, None
        if answer is None:
            return self.post(url, **kwargs)
        if not _same_request(url, kwargs.get("json"), answer["url"], answer["json"]):
            raise RuntimeError(
                "async_generation: the request TRL's vLLM client makes now differs from the one sent ahead of time "
                "(trl_compat.vllm_server_sampling_params is out of date for this TRL?); use async_generation=False."
            )
        import requests

        response = requests.models.Response()
        response.status_code, response._content, response.encoding, response.url = (
            200,
            answer["text"].encode(),
            "utf-8",
            url,
        )
        return response

    def close(self):
        seam.restore_session_post(self.client)


class VLLMServerGenerator:
    """TRL's vLLM server path with only the HTTP request in the generator thread (module docstring)."""

    needs_idle_sync = True  # the server holds one set of weights: they change only when no request is in flight

    def __init__(self, trainer, timeout: float):
        self.trainer, self.generation, self.timeout = trainer, trainer.vllm_generation, timeout
        self.main = trainer.accelerator.is_main_process
        self.requests = _ServerRequests(self.generation.vllm_client) if self.main else None
        self.where = getattr(getattr(self.generation, "vllm_client", None), "base_url", "the vLLM server")

    def push_weights(self, busy: bool):
        self.generation.sync_weights()  # collective: every process, main thread
        seam.mark_weights_pushed(self.trainer)  # TRL's own call then finds them current
        return None

    def request(self, request: GenerationRequest, rollout: int, sampled_at: int):
        from accelerate.utils import gather_object

        images, fields, n = trl_compat.single_turn_request(
            self.trainer, request.single_turn_args, request.single_turn_kwargs or {}
        )
        if images is not None or fields:
            raise ValueError("async_generation does not support image prompts yet; set async_generation=False.")
        prompts = gather_object(request.prompt_ids)  # collective, as TRL's server path gathers them
        if not self.main:
            return None
        params = trl_compat.vllm_server_sampling_params(self.generation, n)
        client = self.generation.vllm_client
        url, kwargs = self.requests.capture(lambda: client.generate(prompts=prompts[::n], **params))
        return functools.partial(self.requests.send, url, kwargs, self.timeout)

    def completions(self, result) -> Completions:
        return Completions(sampled_at=-1)  # no ids: TRL's server path runs, `answering` makes its client answer

    def answering(self, result):
        requests = self.requests

        class _Answer:
            def __enter__(self):
                if requests is not None:
                    requests.answer(result)

            def __exit__(self, *exc):
                if requests is not None:
                    requests.answer(None)
                return False

        return _Answer()

    def close(self):
        if self.requests is not None:
            self.requests.close()
