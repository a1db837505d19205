# Engine itself: `minisgl.engine.engine` (torch), imported where used; EngineConfig is read by
# processes without torch (issue 47)
from minisgl.engine.config import EngineConfig

__all__ = ["EngineConfig"]
