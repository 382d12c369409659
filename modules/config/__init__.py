from modules.config.errors import ConfigError
from modules.config.loading import build_config, load_config_file, validate_config
from modules.config.train_config import CURRENT_VERSION, TrainConfig

__all__ = ["ConfigError", "TrainConfig", "CURRENT_VERSION", "build_config", "load_config_file", "validate_config"]
