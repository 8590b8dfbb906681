"""LoRA adapters in the embedded engine, served as SGLang 0.5.23 serves them: `/load_lora_adapter
{lora_name, lora_path, pinned}` (a PEFT directory: adapter_config.json + adapter_model.safetensors),
`/load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors, load_format}`,
`/unload_lora_adapter {lora_name}`, each answering SGLang's `LoRAUpdateOutput` {success,
error_message, loaded_adapters}; `lora_path` on /generate names the adapter a request runs with.

The adapters live beside the base weights (`Adapters`): a forward hook on each adapted
nn.Linear adds s B A x to the rows of the batch whose request names that adapter (`rows`, set by
the scheduler before each forward), so requests on different adapters share a batch as they do
in SGLang. A request keeps its adapter from submission to finish (SGLang binds lora_path per
request), and its tokens are tagged with the adapter's version when its name is a StreamRL
version name (`v12`, streamrl/core/lora.py), so per-token versions stay exact.

Differences from SGLang, on purpose: `serialized_named_tensors` entries are safetensors blobs
(`load_format: "safetensors"`): SGLang's are pickled tensors, and this engine never unpickles what
comes over the network; `/load_lora_adapter` paths must be under the engine's weights root, as its
`/update_weights_from_disk` paths are. `/unload_lora_adapter` refuses new requests for the name at
once and returns when no request uses it any more (SGLang's registry waits the same way).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import safetensors.torch
import torch
from aiohttp import web

from streamrl.core import lora as names

TENSOR_FORMAT = "safetensors"


class LoadReq(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class LoadTensorsReq(msgspec.Struct, kw_only=True):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[bytes]  # base64 in JSON
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class UnloadReq(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_id: str | None = None


class Adapters:
    """The loaded adapters of one transformers model and the hooks that apply them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, dict[str, Any]] = {}  # name -> {scale, modules: {module: (A, B)}, path, version}
        self.retiring: set[str] = set()  # being unloaded: no new request may name them
        self.rows: list[str | None] = []  # the adapter of each row of the forward about to run
        self._hooked: set[str] = set()

    def version(self, name: str | None, default: str) -> str:
        """The version a request's tokens are tagged with: its adapter's, or the base weights'."""
        return default if name is None else self.loaded.get(name, {}).get("version", default)

    def check(self, name: str | None) -> None:
        if name is not None and (name not in self.loaded or name in self.retiring):
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}. "
                             f"Loaded adapters: {sorted(set(self.loaded) - self.retiring)}")

    def add(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], path: str) -> None:
        """Check `tensors` (PEFT names) against the model whole, then load them as adapter `name`."""
        if name in self.loaded:
            raise ValueError(f"The LoRA adapter {name!r} is already loaded; unload it first")
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        own = dict(self.model.named_modules())
        modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for mod, key, a, b in names.modules_of(tensors):
            lin = own.get(mod)
            if b is None or not isinstance(lin, torch.nn.Linear):
                raise ValueError(f"adapter tensor {key}: no lora_B beside it or no linear module {mod} in the model")
            if a.shape != (rank, lin.in_features) or b.shape != (lin.out_features, rank):
                raise ValueError(f"{mod}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit rank {rank} and "
                                 f"the layer's {lin.in_features} -> {lin.out_features}")
            w = lin.weight
            modules[mod] = (a.to(w.device, w.dtype), b.to(w.device, w.dtype))
        if not modules:
            raise ValueError("the adapter holds no lora_A / lora_B tensors")
        for mod in modules:
            if mod not in self._hooked:
                own[mod].register_forward_hook(self._hook(mod))
                self._hooked.add(mod)
        v = names.version_of(name)
        self.loaded[name] = {"scale": names.scaling(rank, alpha), "modules": modules, "path": path,
                             "version": str(v) if v is not None else name}

    def remove(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.retiring.discard(name)

    def _hook(self, mod: str) -> Any:
        def hook(_m: Any, args: tuple[Any, ...], y: torch.Tensor) -> torch.Tensor:
            x, rows = args[0], self.rows
            for name in set(rows):
                ad = self.loaded.get(name) if name is not None else None
                if ad is None or mod not in ad["modules"]:
                    continue
                a, b = ad["modules"][mod]
                if all(r == name for r in rows):  # the common case: the whole batch on one adapter
                    y = y + ad["scale"] * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)
                    continue
                idx = torch.tensor([i for i, r in enumerate(rows) if r == name], device=x.device)
                delta = ad["scale"] * torch.nn.functional.linear(torch.nn.functional.linear(x[idx], a), b)
                y = y.index_add(0, idx, delta)
            return y
        return hook

    def listing(self) -> dict[str, str]:
        return {n: ad["path"] for n, ad in self.loaded.items() if n not in self.retiring}


def read_peft_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, the tensors of adapter_model.safetensors) of a PEFT directory."""
    d = Path(path)
    config = json.loads((d / "adapter_config.json").read_text())
    return config, safetensors.torch.load_file(str(d / "adapter_model.safetensors"))


def _out(adapters: Adapters, error: str | None = None) -> web.Response:
    return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": adapters.listing()},
                             status=200 if error is None else 400)


class LoraEndpoints:
    """SGLang's adapter endpoints on an EngineServer (`server.core` runs the model)."""

    def __init__(self, server: Any, decode: Any) -> None:
        self.server, self.core, self.decode = server, server.core, decode  # decode(request, Struct): 400 on bad JSON
        self.adapters: Adapters = server.core.adapters
        r = server.app.router
        r.add_post("/load_lora_adapter", self.load)
        r.add_post("/load_lora_adapter_from_tensors", self.load_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload)

    async def _add(self, name: str, read: Any, path: str) -> web.Response:
        loop = asyncio.get_running_loop()
        try:
            config, tensors = await loop.run_in_executor(None, read)
            await loop.run_in_executor(None, self.core.call, lambda: self.adapters.add(name, config, tensors, path))
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            return _out(self.adapters, f"Failed to load LoRA adapter {name}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on a bad file or blob
            return _out(self.adapters, f"Failed to load LoRA adapter {name}: {type(e).__name__}: {e}")
        return _out(self.adapters)

    async def load(self, request: web.Request) -> web.Response:
        req: LoadReq = await self.decode(request, LoadReq)
        root = self.server.weights_root
        real = os.path.realpath(req.lora_path)
        if root is not None and os.path.commonpath([real, root]) != root:
            return _out(self.adapters, f"lora_path {req.lora_path!r} is outside this engine's weights directory "
                                       f"{root}: refused")
        return await self._add(req.lora_name, lambda: read_peft_dir(req.lora_path), req.lora_path)

    async def load_from_tensors(self, request: web.Request) -> web.Response:
        req: LoadTensorsReq = await self.decode(request, LoadTensorsReq)
        if req.load_format != TENSOR_FORMAT:
            return _out(self.adapters, f"load_format {req.load_format!r} is refused: SGLang's entries are pickled "
                                       "tensors and this engine never unpickles what comes over the network; send "
                                       f"load_format {TENSOR_FORMAT!r} with each entry a base64 safetensors blob")

        def read() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            tensors: dict[str, torch.Tensor] = {}
            for blob in req.serialized_named_tensors[:1]:  # one copy per TP rank: this process is one rank
                tensors.update(safetensors.torch.load(blob))
            return req.config_dict, tensors

        return await self._add(req.lora_name, read, "__tensor__")

    async def unload(self, request: web.Request) -> web.Response:
        req: UnloadReq = await self.decode(request, UnloadReq)
        name = req.lora_name
        if name not in self.adapters.loaded or name in self.adapters.retiring:
            return _out(self.adapters, f"LoRA adapter {name} is not loaded")
        self.adapters.retiring.add(name)  # no new request from now on
        while await asyncio.get_running_loop().run_in_executor(None, self.core.call,
                                                                lambda: self.core.uses_adapter(name)):
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.core.call, lambda: self.adapters.remove(name))
        return _out(self.adapters)
