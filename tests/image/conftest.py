"""Build the container images once per session (tests marked ``image``).

The images are built by ``hack/build-image.sh`` (:func:`imagekit.build_images`)
right after collection and before the first test, so a cold build is not cut
short by a test's timeout. A failed build is an ERROR of every image test, never
a skip. Containers are run with :func:`imagekit.container`.
"""

from __future__ import annotations

import pytest
from imagekit import CACHE, build_images

_BUILD = pytest.StashKey[tuple[dict[str, str], str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker("image") for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"image tests: building the images first (log {CACHE / 'image-build.log'})"
            )
        session.config.stash[_BUILD] = build_images()


@pytest.fixture(scope="session")
def images(request: pytest.FixtureRequest) -> dict[str, str]:
    built = request.config.stash.get(_BUILD, None)
    refs, error = built if built is not None else build_images()
    if error:
        pytest.fail(error, pytrace=False)
    return refs
