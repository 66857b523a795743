"""A further front-end process of ``detlora serve --api-server-count N`` (``front_ends.py``):
it attaches to the engine the first front end started, through the pipes it was handed,
loads the ``--lora-modules``, and serves the shared listening socket until a signal or until
the engine goes away."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import socket
import sys

from detlora.engine.async_llm import AsyncLLM
from detlora.engine_args import EngineArgs
from detlora.entrypoints.openai.front_ends import unfinished_share
from detlora.entrypoints.openai.server_config import ServerConfig

logger = logging.getLogger("detlora.server")


async def serve_attached(engine_config: EngineArgs, config: ServerConfig,
                         tokenizer_dir: str | None, to_engine: int, from_engine: int,
                         sock: socket.socket, ready: int, index: int) -> None:
    """One further front end: attach to the engine, load the adapters, serve until a signal
    or until the engine goes away; a byte on ``ready`` once it serves."""
    import uvicorn

    from detlora.entrypoints.openai.api_server import build_app
    from detlora.entrypoints.openai.errors import OpenAIError
    from detlora.entrypoints.openai.serving_models import ServingModels

    llm = await AsyncLLM.attach(engine_config, to_engine, from_engine,
                                tokenizer_dir=tokenizer_dir,
                                max_unfinished=unfinished_share(engine_config, config))
    os.close(to_engine)
    os.close(from_engine)
    try:
        models = ServingModels(llm, config.served_model_name, lora_root=config.lora_root,
                               enable_loading=False)
        for name, path in config.lora_modules:
            try:
                await models.add(name, path, trusted=True)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
        uv = uvicorn.Server(uvicorn.Config(
            build_app(llm, models, config), log_level=config.log_level, access_log=False,
            timeout_graceful_shutdown=max(1, int(config.graceful_timeout)), lifespan="off"))

        async def watch_engine() -> None:
            while not uv.started:
                await asyncio.sleep(0.05)
            os.write(ready, b"1")
            os.close(ready)
            while llm.is_alive:  # until the first front end and the engine go away
                await asyncio.sleep(1.0)
            uv.should_exit = True

        watcher = asyncio.ensure_future(watch_engine())
        gc.collect()
        gc.freeze()
        try:
            await uv.serve(sockets=[sock])
        finally:
            watcher.cancel()
    finally:
        await llm.shutdown()
    logger.info("front end %d stopped", index)


def main() -> None:
    """``python -m detlora.entrypoints.openai.front_end_proc``: (engine config, server config,
    tokenizer dir, to-engine fd, from-engine fd, socket fd, ready fd, index) pickled on
    stdin."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_config, config, tokenizer_dir, to_engine, from_engine, sock_fd, ready, index = \
        pickle.loads(sys.stdin.buffer.read())
    sock = socket.socket(fileno=sock_fd)
    try:
        asyncio.run(serve_attached(engine_config, config, tokenizer_dir, to_engine,
                                   from_engine, sock, ready, index))
    except ValueError as e:  # an adapter refused, the engine gone before it was ready
        logger.error("front end %d: %s", index, e)
        sys.exit(2)


__all__ = ["main", "serve_attached"]


if __name__ == "__main__":
    main()
