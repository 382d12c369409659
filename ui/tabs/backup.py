"""Backup: backup and save cadence, how many backups to keep, resume from the last backup."""

from __future__ import annotations

from ui.components import section
from ui.tabs import Tab
from ui.tabs.sampling import cadence


class BackupTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Backups (adapter, optimizer, position: to resume)")
        cadence(self, self, "schedule.backup_every", "Backup every")
        self.field(self, "backup.rolling_count", "Keep the newest", "int")
        self.field(self, "backup.resume", "Resume from the last backup", "bool", widget="switch")
        section(self, "Saves (the adapter alone, into workspace/save)")
        cadence(self, self, "schedule.save_every", "Save every")
