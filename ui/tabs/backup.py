"""Backup: backup and save cadence, how many backups to keep, resume from the last backup, and the
validation cadence."""

from __future__ import annotations

from modules.config.train_config import BackupConfig, ScheduleConfig
from ui.components import section
from ui.tabs import Tab


class BackupTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Backups (adapter, optimizer, position: to resume)")
        self.form(self, ScheduleConfig, "schedule", ["backup_every"])
        self.form(self, BackupConfig, "backup")
        section(self, "Saves (the adapter alone, into workspace/save)")
        self.form(self, ScheduleConfig, "schedule", ["save_every"])
        section(self, "Validation (concepts marked validation)")
        self.form(self, ScheduleConfig, "schedule", ["validate_every"])
