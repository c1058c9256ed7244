"""The playground: a static page (HTML, CSS, JavaScript shipped in the package, no build step, no
CDN) served at ``/`` and ``/playground``, its files under ``/static``. The page holds no secret;
it asks for the API key and calls the API like any client (see docs/playground.md)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
# Only the page's own files and API calls to this server: injected markup can neither run nor leak the key.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

router = APIRouter()


@router.get("/", include_in_schema=False)
@router.get("/playground", include_in_schema=False)
async def page() -> FileResponse:
    """The page itself, open without a key: it holds no secret and asks for one. ``no-cache``: the
    browser revalidates it, so an upgraded server's page shows at once."""
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


def mount_static(app: FastAPI) -> None:
    """The page's CSS, JavaScript modules and icon, from the package (no build step, no CDN)."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
