"""All routers of API v1, collected in one place."""

from fastapi import APIRouter

from service.api import agents, ett, events, jobs

api_router = APIRouter(prefix="/api/v1")
api_router.include_router(jobs.router)
api_router.include_router(agents.router)
api_router.include_router(events.router)
api_router.include_router(ett.router)
