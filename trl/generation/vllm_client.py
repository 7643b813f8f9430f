"""HTTP client of `trl vllm-serve`: generation, chat, sequence log-probs and trainer -> server weight pushes.

The server is started with `trl vllm-serve --model <model>` (see `trl/scripts/vllm_serve.py`). Generation goes
through plain HTTP; weights go through a dedicated process group (NCCL between GPUs, gloo through host memory
otherwise, see `trl.generation.weight_sync`), announced by an HTTP call and then broadcast from the trainer.
"""

import atexit
import base64
import io
import logging
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from ..import_utils import is_requests_available
from .openai_scoring import completions_scoring_payload, parse_prompt_logprobs
from .weight_sync import WeightSyncGroup, create_weight_sync_group, default_backend, pack_tensors


logger = logging.getLogger(__name__)

if is_requests_available():
    import requests
    from requests import ConnectionError as _RequestsConnectionError
else:  # pragma: no cover - requests ships with transformers' dependencies
    requests = None
    _RequestsConnectionError = ConnectionError

# Upper bound on the bytes packed into one broadcast by `update_named_params` (bounds the extra memory of a push).
_MAX_PACKED_BYTES = 256 * 1024 * 1024


def pil_to_base64(image: Any) -> str:
    """Encode a PIL image as a base64 PNG string (the form the server accepts in `images`).

    Args:
        image (`PIL.Image.Image`): Image to encode.

    Returns:
        `str`: Base64 text of the PNG bytes (no `data:` prefix).
    """
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def _data_url(image: Any) -> str:
    """A PIL image as an OpenAI-style `data:image/png;base64,...` URL."""
    return f"data:image/png;base64,{pil_to_base64(image)}"


def _is_pil_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def to_openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Convert TRL-style messages to the OpenAI chat format vLLM's chat endpoint reads.

    String contents are kept. In list contents, `{"type": "image", "image": <PIL image>}` parts become
    `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`; an image part without an inline
    image (a placeholder) is dropped; other parts are kept. Messages are copied, never modified in place.

    Args:
        messages (`list[dict]`): One conversation.

    Returns:
        `list[dict]`: The converted conversation.
    """
    converted = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    image = part.get("image")
                    if image is None:
                        continue
                    url = image if isinstance(image, str) else f"data:image/png;base64,{pil_to_base64(image)}"
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                elif _is_pil_image(part):
                    parts.append(
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pil_to_base64(part)}"}}
                    )
                else:
                    parts.append(part)
            message["content"] = parts
        converted.append(message)
    return converted


def _token_id(token: Any) -> int:
    # vLLM's OpenAI server writes tokens as "token_id:<id>" with `return_tokens_as_token_ids`.
    if isinstance(token, int):
        return token
    text = str(token)
    return int(text.split(":", 1)[1]) if text.startswith("token_id:") else int(text)


def parse_logprobs(choices_logprobs: Sequence[Any]) -> tuple[list[list[list[float]]], list[list[list[int]]]]:
    """Read the `logprobs` objects of OpenAI-style choices into nested lists.

    Accepts the chat form (`{"content": [{"token", "logprob", "top_logprobs": [...]}, ...]}`) and the completions
    form (`{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...]}`). Tokens must be
    written as ids (`"token_id:123"` or plain integers), as vLLM does with `return_tokens_as_token_ids`.

    Args:
        choices_logprobs (`Sequence`): One `logprobs` object (or `None`) per choice.

    Returns:
        `tuple[list, list]`: `(logprobs, token_ids)`, each indexed `[choice][position][k]`, with the sampled token
        first at every position followed by the other top tokens in rank order. A choice without logprobs gives
        empty lists.
    """
    all_logprobs, all_token_ids = [], []
    for choice in choices_logprobs:
        logprobs, token_ids = [], []
        if choice is None:
            pass
        elif "content" in choice and choice["content"] is not None:
            for entry in choice["content"]:
                sampled = _token_id(entry["token"])
                row_ids, row_lps = [sampled], [entry["logprob"]]
                for top in entry.get("top_logprobs") or []:
                    tid = _token_id(top["token"])
                    if tid != sampled:
                        row_ids.append(tid)
                        row_lps.append(top["logprob"])
                logprobs.append(row_lps)
                token_ids.append(row_ids)
        else:
            tops = choice.get("top_logprobs") or [None] * len(choice.get("tokens") or [])
            for token, logprob, top in zip(choice.get("tokens") or [], choice.get("token_logprobs") or [], tops):
                sampled = _token_id(token)
                row_ids, row_lps = [sampled], [logprob]
                for other, other_lp in (top or {}).items():
                    tid = _token_id(other)
                    if tid != sampled:
                        row_ids.append(tid)
                        row_lps.append(other_lp)
                logprobs.append(row_lps)
                token_ids.append(row_ids)
        all_logprobs.append(logprobs)
        all_token_ids.append(token_ids)
    return all_logprobs, all_token_ids


def _decode_array(encoded: str, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(encoded))
    tensor = torch.frombuffer(raw, dtype=getattr(torch, dtype)) if raw else torch.empty(0, dtype=getattr(torch, dtype))
    return tensor.reshape(tuple(shape))


def fetch_server_info(session: Any, base_url: str, timeout: float | None = None) -> dict:
    """GET `{base_url}/server_info?config_format=json` and return its `vllm_config` tree.

    Raises:
        RuntimeError: On 404 (a plain `vllm serve` exposes the endpoint only with `VLLM_SERVER_DEV_MODE=1`).
        Exception: On any other non-200 answer.
    """
    response = session.get(f"{base_url}/server_info", params={"config_format": "json"}, timeout=timeout)
    if response.status_code == 404:
        raise RuntimeError(
            f"The vLLM server at {base_url} has no /server_info endpoint. Restart it with VLLM_SERVER_DEV_MODE=1 "
            "(vllm serve), or use `trl vllm-serve`."
        )
    if response.status_code != 200:
        raise Exception(f"Request /server_info failed: {response.status_code}, {response.text}")
    return response.json()["vllm_config"]


_warned_temperatures: set[float] = set()


def _warn_prompt_logprobs_temperature(temperature: float) -> None:
    if temperature in _warned_temperatures:
        return
    _warned_temperatures.add(temperature)
    warnings.warn(
        f"Sequence log-probs were requested at temperature {temperature}, but vLLM returns prompt log-probabilities "
        "at temperature 1.0 whatever the request says: the teacher is scored at 1.0 (as TRL 1.16's teacher servers "
        "score it) while the student's log-probs use the trainer's temperature. Set temperature=1.0 to compare both "
        "at the same temperature.",
        UserWarning,
        stacklevel=3,
    )


class VLLMClient:
    """Client of a `trl vllm-serve` server.

    Generation (`generate`, `chat`), scoring (`get_sequence_logprobs`) and weight pushes (`init_communicator`, then
    `update_named_param` / `update_model_params`, then `close_communicator`). Weight pushes use NCCL when the
    trainer's device is a CUDA GPU and vLLM is installed in the trainer's environment, and a gloo process group
    through host memory otherwise (CPU trainers and CPU servers).

    Args:
        base_url (`str` or `None`, *optional*, defaults to `None`):
            Full URL of the server (e.g. `"http://10.0.0.5:8000"`). Overrides `host` and `server_port`.
        host (`str`, *optional*, defaults to `"0.0.0.0"`):
            Server address (`"0.0.0.0"` reaches a server on this machine).
        server_port (`int`, *optional*, defaults to `8000`):
            Server HTTP port.
        group_port (`int`, *optional*, defaults to `51216`):
            Port of the weight-transfer group's TCP store, opened on the server's machine.
        connection_timeout (`float`, *optional*, defaults to `0.0`):
            Seconds to keep retrying the server's health endpoint before giving up with a `ConnectionError`.

    Example:

    ```python
    >>> from trl.generation.vllm_client import VLLMClient

    >>> client = VLLMClient(host="127.0.0.1", server_port=8000, connection_timeout=60)
    >>> client.generate(["Hello, AI!", "Tell me a joke"], max_tokens=8)["completion_ids"]
    [[2980, 498, 1492, 752, 448, 13, 151645], [19434, 1052, 13, 151645]]
    >>> client.init_communicator()
    >>> client.update_model_params(model)
    ```
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
    ):
        if requests is None:
            raise ImportError("VLLMClient needs `requests`: `pip install requests` (or `pip install trl[vllm]`).")
        self.session = requests.Session()
        if base_url is not None:
            parsed = urlparse(base_url if "://" in base_url else f"http://{base_url}")
            if not parsed.hostname:
                raise ValueError(f"Expected a server URL such as 'http://127.0.0.1:8000', got {base_url!r}.")
            self.host = parsed.hostname
            self.server_port = parsed.port or (443 if parsed.scheme == "https" else 80)
            self.base_url = f"{parsed.scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        else:
            self.host = host
            self.server_port = server_port
            self.base_url = f"http://{host}:{server_port}"
        self.group_port = group_port
        self.communicator: WeightSyncGroup | None = None
        self.rank: int | None = None
        self.check_server(connection_timeout)

    # -- plumbing ----------------------------------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return f"{self.base_url}/{path.strip('/')}/"

    def _post(self, path: str, payload: dict | None = None) -> dict:
        response = self.session.post(self._url(path), json=payload if payload is not None else {})
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server request {path} failed: {response.status_code}, {response.text}")
        return response.json()

    def _get(self, path: str) -> dict:
        response = self.session.get(self._url(path))
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server request {path} failed: {response.status_code}, {response.text}")
        return response.json()

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        """Poll the server's health endpoint until it answers or `total_timeout` seconds have passed.

        A proxy in front of the server may name the real server address in an `X-Forwarded-For` header; the client
        then uses that address for the weight-transfer group.

        Args:
            total_timeout (`float`, *optional*, defaults to `0.0`):
                Seconds to keep trying (a single attempt when 0).
            retry_interval (`float`, *optional*, defaults to `2.0`):
                Seconds between attempts.

        Raises:
            ConnectionError: When the server cannot be reached in time.
        """
        url = self._url("health")
        start = time.monotonic()
        while True:
            try:
                response = self.session.get(url, timeout=max(retry_interval, 1.0))
            except requests.exceptions.RequestException:
                response = None
            if response is not None and response.status_code == 200:
                forwarded = response.headers.get("X-Forwarded-For")
                if forwarded:
                    self.host = forwarded.split(",")[0].strip()
                logger.info("vLLM server is up at %s", self.base_url)
                return
            elapsed = time.monotonic() - start
            if elapsed >= total_timeout:
                raise ConnectionError(
                    f"The vLLM server can't be reached at {self.host}:{self.server_port} ({self.base_url}) after "
                    f"{total_timeout} seconds. Make sure the server is running (`trl vllm-serve --model <model> "
                    f"--host {self.host} --port {self.server_port}`) or raise `vllm_server_timeout`."
                )
            time.sleep(min(retry_interval, max(total_timeout - elapsed, 0.0)))

    # -- generation --------------------------------------------------------------------------------------------------

    def get_server_info(self) -> dict:
        """The server's configuration tree: GET `/server_info?config_format=json`, its `vllm_config`.

        Returns:
            `dict`: vLLM's configuration (`model_config`, `parallel_config`, `lora_config`, ...).

        Raises:
            RuntimeError: When the server has no such endpoint (a plain `vllm serve` exposes it only with
                `VLLM_SERVER_DEV_MODE=1`).
            Exception: On any other non-200 answer.
        """
        return fetch_server_info(self.session, self.base_url)

    def image_features(self, images: list[list | None], max_concurrent_requests: int = 64) -> list[dict | None]:
        """Multimodal features of each prompt's images, rendered by the server (`/v1/chat/completions/render`).

        One request per prompt (at most `max_concurrent_requests` at once): a single user message holding one image
        block per image. Features depend on the images only, so they can be reused for any prompt text.

        Args:
            images (`list[list | None]`):
                Per prompt, its images (PIL images or base64 data URLs), or `None` for a text-only prompt.
            max_concurrent_requests (`int`, *optional*, defaults to `64`):
                Requests in flight at once.

        Returns:
            `list[dict | None]`: The server's `features` per prompt, `None` where the prompt has no images.

        Raises:
            RuntimeError: When the server has no render endpoint (vLLM >= 0.30 needs `--enable-scale-out`).
        """
        model = self.get_server_info().get("model_config", {}).get("model") if images else None

        def render(prompt_images):
            if not prompt_images:
                return None
            content = [
                {"type": "image_url", "image_url": {"url": image if isinstance(image, str) else _data_url(image)}}
                for image in prompt_images
            ]
            payload = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
            response = self.session.post(f"{self.base_url}/v1/chat/completions/render", json=payload)
            if response.status_code == 404:
                raise RuntimeError(
                    f"The vLLM server at {self.base_url} has no /v1/chat/completions/render endpoint (vLLM >= 0.30 "
                    "serves it with --enable-scale-out)."
                )
            if response.status_code != 200:
                raise RuntimeError(
                    f"Request /v1/chat/completions/render failed: {response.status_code}, {response.text}"
                )
            return response.json().get("features")

        workers = max(1, min(max_concurrent_requests, len(images)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(render, images))

    def get_world_size(self) -> int:
        """Number of vLLM workers behind the server (tensor parallel size times data parallel size)."""
        return int(self._get("get_world_size")["world_size"])

    @staticmethod
    def _sampling_payload(
        n, repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, logprobs, regex, generation_kwargs
    ) -> dict:
        return {
            "n": n,
            "repetition_penalty": repetition_penalty,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "structured_outputs_regex": regex,
            "generation_kwargs": generation_kwargs or {},
        }

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        images: list | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
        lora_name: str | None = None,
    ) -> dict[str, list]:
        """Generate completions for text prompts or token-id prompts.

        Args:
            prompts (`list[str]` or `list[list[int]]`):
                Prompts as text or as token ids.
            images (`list` or `None`, *optional*, defaults to `None`):
                Per prompt: a PIL image, a list of PIL images, or `None`.
            n (`int`, *optional*, defaults to `1`):
                Completions per prompt.
            repetition_penalty (`float`, *optional*, defaults to `1.0`):
                Penalty for repeated tokens (1.0 = none).
            temperature (`float`, *optional*, defaults to `1.0`):
                Sampling temperature (0 = greedy).
            top_p (`float`, *optional*, defaults to `1.0`):
                Nucleus sampling mass.
            top_k (`int`, *optional*, defaults to `0`):
                Top-k sampling (0 or -1 = off).
            min_p (`float`, *optional*, defaults to `0.0`):
                Minimum token probability relative to the most likely one.
            max_tokens (`int`, *optional*, defaults to `16`):
                Maximum completion length.
            logprobs (`int` or `None`, *optional*, defaults to `0`):
                Number of top log-probs returned per token besides the sampled token's; `None` returns none.
            structured_outputs_regex (`str` or `None`, *optional*, defaults to `None`):
                Regex the completion must match.
            generation_kwargs (`dict` or `None`, *optional*, defaults to `None`):
                Extra vLLM `SamplingParams` fields; they override the arguments above.
            lora_name (`str` or `None`, *optional*, defaults to `None`):
                Generate with this LoRA adapter, loaded on the server with `/v1/load_lora_adapter` (a server started
                with `--enable_lora`); `None` generates with the base model.

        Returns:
            `dict`: `prompt_ids` (one list per prompt), `completion_ids` (`n` lists per prompt, grouped by prompt),
            `logprobs` and `logprob_token_ids` (per completion, per token: the sampled token first, then the top
            others; `None` when `logprobs` is `None`).
        """
        payload = {"prompts": prompts, "images": self._encode_images(images)}
        payload.update(
            self._sampling_payload(
                n, repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, logprobs,
                structured_outputs_regex, generation_kwargs,
            )
        )  # fmt: skip
        if lora_name is not None:
            payload["lora_name"] = lora_name
        return self._post("generate", payload)

    @staticmethod
    def _encode_images(images: list | None) -> list | None:
        if images is None:
            return None
        encoded = []
        for item in images:
            if item is None:
                encoded.append(None)
            elif isinstance(item, (list, tuple)):
                encoded.append([image if isinstance(image, str) else pil_to_base64(image) for image in item])
            else:
                encoded.append([item if isinstance(item, str) else pil_to_base64(item)])
        return encoded

    def chat(
        self,
        messages: list[list[dict]],
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
        chat_template: str | None = None,
        lora_name: str | None = None,
    ) -> dict[str, list]:
        """Generate assistant replies for conversations (the server applies the model's chat template).

        Args:
            messages (`list[list[dict]]`):
                Conversations; images inside messages (PIL) are sent inline.
            n, repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, logprobs, structured_outputs_regex,
            generation_kwargs, lora_name:
                As in [`~VLLMClient.generate`].
            chat_template_kwargs (`dict` or `None`, *optional*, defaults to `None`):
                Extra variables for the chat template (e.g. `{"enable_thinking": False}`).
            tools (`list` or `None`, *optional*, defaults to `None`):
                Tool schemas (JSON dicts) rendered by the chat template.
            chat_template (`str` or `None`, *optional*, defaults to `None`):
                Jinja template overriding the model's.

        Returns:
            `dict`: Same keys as [`~VLLMClient.generate`]; `prompt_ids` are the templated conversations.
        """
        payload = {
            "messages": [to_openai_messages(conversation) for conversation in messages],
            "chat_template_kwargs": chat_template_kwargs or {},
            "tools": tools,
            "chat_template": chat_template,
        }
        payload.update(
            self._sampling_payload(
                n, repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, logprobs,
                structured_outputs_regex, generation_kwargs,
            )
        )  # fmt: skip
        if lora_name is not None:
            payload["lora_name"] = lora_name
        return self._post("chat", payload)

    def get_sequence_logprobs(
        self,
        sequences: list[list[int]],
        prompt_lengths: list[int],
        top_logprobs: int = 100,
        temperature: float = 1.0,
        use_binary: bool = True,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
        lora_name: str | None = None,
    ) -> dict[str, list]:
        """Score fixed completions: the server's log-probs of every completion token of `sequences`.

        Args:
            sequences (`list[list[int]]`):
                Prompt + completion token ids.
            prompt_lengths (`list[int]`):
                Prompt length of each sequence; the positions after it are scored.
            top_logprobs (`int`, *optional*, defaults to `100`):
                Number of top tokens returned per position.
            temperature (`float`, *optional*, defaults to `1.0`):
                Logit temperature; must be positive. vLLM computes prompt log-probabilities at temperature 1.0
                whatever the request says (checked with vLLM 0.32, `--logprobs-mode processed_logprobs`), so a
                value other than 1.0 warns and the scores are at 1.0 on both server kinds, as TRL 1.16 gets them.
            use_binary (`bool`, *optional*, defaults to `True`):
                Transfer arrays as base64 binary instead of JSON numbers (smaller, faster).
            chunk_size (`int`, *optional*, defaults to `0`):
                Sequences per request (0 = all in one request).
            max_concurrent_requests (`int`, *optional*, defaults to `4`):
                Requests in flight at once when chunking.
            lora_name (`str` or `None`, *optional*, defaults to `None`):
                Score with this loaded LoRA adapter (the `model` of a plain `vllm serve` request); `None` scores with
                the base model.

        Returns:
            `dict[str, list]`: Per sequence, per completion position: `logprobs` and `logprob_token_ids` (top
            `top_logprobs`, padded with `-inf` / `0` where fewer exist), `actual_logprobs` and `actual_token_ids`
            (the log-prob of the token actually in the sequence, and that token).

        Raises:
            ValueError: On a non-positive temperature or mismatched lengths.
        """
        if temperature <= 0:
            raise ValueError(f"Expected a positive temperature for sequence log-probs, got {temperature}.")
        if len(sequences) != len(prompt_lengths):
            raise ValueError(
                f"Expected one prompt length per sequence, got {len(prompt_lengths)} lengths for {len(sequences)} "
                "sequences."
            )
        size = chunk_size if chunk_size > 0 else max(len(sequences), 1)
        chunks = [(sequences[i : i + size], prompt_lengths[i : i + size]) for i in range(0, len(sequences), size)]
        openai = self._scoring_api() == "openai"
        if temperature != 1.0:
            _warn_prompt_logprobs_temperature(temperature)
            if not openai:
                temperature = 1.0  # what a `vllm serve` teacher returns whatever the request says (see the warning)

        def score(chunk):
            if openai:  # a plain `vllm serve`: prompt log-probs of a one-token completion request
                model = lora_name if lora_name is not None else self._served_model()
                payload = completions_scoring_payload(model, chunk[0], top_logprobs, temperature)
                response = self.session.post(f"{self.base_url}/v1/completions", json=payload)
                if response.status_code != 200:
                    raise RuntimeError(
                        f"vLLM server request /v1/completions failed: {response.status_code}, {response.text}"
                    )
                return parse_prompt_logprobs(response.json()["choices"], chunk[0], chunk[1], top_logprobs)
            payload = {
                "sequences": chunk[0],
                "prompt_lengths": chunk[1],
                "top_logprobs": top_logprobs,
                "temperature": temperature,
                "response_format": "binary" if use_binary else "json",
            }
            if lora_name is not None:
                payload["lora_name"] = lora_name
            response = self._post("get_sequence_logprobs", payload)
            return self._decode_sequence_logprobs(response) if use_binary else response

        if len(chunks) > 1 and max_concurrent_requests > 1:
            with ThreadPoolExecutor(max_workers=max_concurrent_requests) as pool:
                results = list(pool.map(score, chunks))
        else:
            results = [score(chunk) for chunk in chunks]
        merged: dict[str, list] = {
            "logprobs": [],
            "logprob_token_ids": [],
            "actual_logprobs": [],
            "actual_token_ids": [],
        }
        for result in results:
            for key in merged:
                merged[key].extend(result[key])
        return merged

    def _scoring_api(self) -> str:
        """How this server scores sequences: `"trl"` (`trl vllm-serve`'s `/get_sequence_logprobs/`) or `"openai"`
        (a plain `vllm serve`: `/v1/completions` with `prompt_logprobs`), read once from the endpoints it lists in
        `/openapi.json` (or, without that, from whether it answers `/v1/models`)."""
        if getattr(self, "_scoring_route", None) is None:
            response = self.session.get(f"{self.base_url}/openapi.json")
            if response.status_code == 200:
                paths = {path.rstrip("/") for path in (response.json().get("paths") or {})}
                trl_route = "/get_sequence_logprobs" in paths or "/v1/completions" not in paths
            else:
                trl_route = self.session.get(f"{self.base_url}/v1/models").status_code != 200
            self._scoring_route = "trl" if trl_route else "openai"
        return self._scoring_route

    def _served_model(self) -> str:
        """The model name an OpenAI-compatible server serves (the first of GET `/v1/models`)."""
        if getattr(self, "_served_model_id", None) is None:
            response = self.session.get(f"{self.base_url}/v1/models")
            if response.status_code != 200:
                raise RuntimeError(f"vLLM server request /v1/models failed: {response.status_code}, {response.text}")
            self._served_model_id = response.json()["data"][0]["id"]
        return self._served_model_id

    @staticmethod
    def _decode_sequence_logprobs(response: dict) -> dict[str, list]:
        shape = response["shape"]  # [num_sequences, max_completion_length, top_k]
        lengths = response["completion_lengths"]
        top = _decode_array(response["logprobs_b64"], "float32", shape)
        top_ids = _decode_array(response["token_ids_b64"], "int32", shape)
        actual = _decode_array(response["actual_logprobs_b64"], "float32", shape[:2])
        actual_ids = _decode_array(response["actual_token_ids_b64"], "int32", shape[:2])
        out: dict[str, list] = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
        for i, length in enumerate(lengths):
            out["logprobs"].append(top[i, :length].tolist())
            out["logprob_token_ids"].append(top_ids[i, :length].tolist())
            out["actual_logprobs"].append(actual[i, :length].tolist())
            out["actual_token_ids"].append(actual_ids[i, :length].tolist())
        return out

    def reset_prefix_cache(self) -> None:
        """Drop the server's cached prompt prefixes (stale once weights change)."""
        self._post("reset_prefix_cache")

    # -- weight transfer ---------------------------------------------------------------------------------------------

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Open the weight-transfer group between this trainer process and every vLLM worker of the server.

        The group has `world_size + 1` ranks: the server's workers, then this client (last rank). Its backend is
        NCCL when `device` is a CUDA device (an int means `cuda:<int>` when CUDA is available) and vLLM is
        installed here, gloo through host memory otherwise.

        Args:
            device (`torch.device`, `str` or `int`, *optional*, defaults to `0`):
                Device holding the trainer's weights.
        """
        if self.communicator is not None:
            return
        backend = default_backend(device)
        if backend == "nccl":
            from ..import_utils import is_vllm_available

            if not is_vllm_available():
                logger.warning("vLLM is not installed in the trainer's environment: pushing weights with gloo.")
                backend = "gloo"
        if backend == "nccl":
            cuda_device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            client_device_uuid = str(torch.cuda.get_device_properties(cuda_device).uuid)
        else:
            cuda_device = None
            client_device_uuid = "cpu"
        world_size = self.get_world_size() + 1
        self.rank = world_size - 1
        # The server's first worker opens the TCP store; a loopback client keeps the whole group on loopback.
        local = self.host in ("0.0.0.0", "localhost") or self.host.startswith("127.") or self.host == "::1"
        self._post(
            "init_communicator",
            {
                "host": "127.0.0.1" if local else "0.0.0.0",
                "port": self.group_port,
                "world_size": world_size,
                "client_device_uuid": client_device_uuid,
                "backend": backend,
            },
        )
        # Let the server's workers start opening the store before connecting to it.
        time.sleep(0.1)
        connect_host = "127.0.0.1" if local else self.host
        self.communicator = create_weight_sync_group(
            connect_host, self.group_port, self.rank, world_size, backend=backend, device=cuda_device
        )
        atexit.register(self.close_communicator)

    def _require_communicator(self) -> WeightSyncGroup:
        if self.communicator is None:
            raise RuntimeError("Call `init_communicator()` before pushing weights to the vLLM server.")
        return self.communicator

    def _to_group_device(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        return tensor.to(self.communicator.device).contiguous()

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """Push one parameter (checkpoint name, e.g. `"model.layers.0.mlp.up_proj.weight"`) to every worker.

        The server applies pushed weights before its next generation. On servers that repack weights (vLLM on
        CPU), push every parameter of a layer in the same sync, as `update_model_params` does.

        Args:
            name (`str`): Parameter name as in the model's checkpoint.
            weights (`torch.Tensor`): New value.
        """
        communicator = self._require_communicator()
        tensor = self._to_group_device(weights)
        self._post("update_named_param", {"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape)})
        communicator.broadcast(tensor, src=self.rank)

    def update_named_params(
        self,
        metadata: Iterable[tuple[str, str, Sequence[int]]] | None = None,
        named_params: Iterator[tuple[str, torch.Tensor]] | Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """Push many parameters, packed into few broadcasts.

        Args:
            metadata (`Iterable[tuple[str, str, Sequence[int]]]` or `None`, *optional*):
                `(name, dtype string, shape)` per parameter. Derived from `named_params` when `None`.
            named_params (`Iterable[tuple[str, torch.Tensor]]`):
                `(name, tensor)` pairs, in the same order as `metadata`.
        """
        communicator = self._require_communicator()
        if named_params is None:
            raise ValueError("Expected `named_params`, an iterable of (name, tensor) pairs, got None.")
        announced = list(metadata) if metadata is not None else None
        batch: list[tuple[str, torch.Tensor]] = []
        batch_bytes = 0
        index = 0

        def flush():
            nonlocal batch, batch_bytes
            if not batch:
                return
            entries = [{"name": n, "dtype": str(t.dtype), "shape": list(t.shape)} for n, t in batch]
            buffer = pack_tensors([t for _, t in batch])
            self._post("update_named_params", {"params": entries, "packed_bytes": int(buffer.numel())})
            communicator.broadcast(buffer, src=self.rank)
            batch, batch_bytes = [], 0

        for name, tensor in named_params:
            tensor = self._to_group_device(tensor)
            if announced is not None:
                if index >= len(announced) or announced[index][0] != name:
                    raise ValueError(f"Expected `named_params` in the order of `metadata`; got {name!r} at {index}.")
            index += 1
            size = tensor.numel() * tensor.element_size()
            if batch and batch_bytes + size > _MAX_PACKED_BYTES:
                flush()
            batch.append((name, tensor))
            batch_bytes += size
        flush()

    @contextmanager
    def weight_update(self):
        """Group several pushes into one weight update; the server applies them all before generating again."""
        self._require_communicator()
        yield self
        self.reset_prefix_cache()

    def update_model_params(self, model: nn.Module) -> None:
        """Push every parameter of `model` (names as in its checkpoint) to the server, then reset its prefix cache.

        Args:
            model (`torch.nn.Module`): Model whose `named_parameters()` match the served model's checkpoint names
                (unwrap DDP/PEFT and merge adapters first).
        """
        with self.weight_update():
            self.update_named_params(named_params=((name, param.data) for name, param in model.named_parameters()))

    def close_communicator(self) -> None:
        """Close the weight-transfer group on the server and here. Safe to call more than once."""
        if self.communicator is None:
            return
        try:
            self._post("close_communicator")
        except (requests.exceptions.RequestException, RuntimeError, _RequestsConnectionError):
            # The server may already be gone (e.g. at interpreter exit); nothing is left to release there.
            pass
        self.communicator.close()
        self.communicator = None
