"""Sampling: cadence, sampler, and the prompt editor (each prompt with all its fields: negative
prompt, seed, steps, cfg, size, enabled); add and remove prompts; sample one now from the running
model."""

from __future__ import annotations

import customtkinter as ctk

from modules.config.train_config import SamplePromptConfig, SamplingConfig, ScheduleConfig
from ui.components import section
from ui.tabs import Tab


class SamplingTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "When")
        self.form(self, ScheduleConfig, "schedule", ["sample_every"])
        self.form(self, SamplingConfig, "sampling", exclude={"prompts"})
        section(self, "Prompts")
        ctk.CTkButton(self, text="Add prompt", width=130, command=self.add).pack(anchor="w", padx=8, pady=4)
        self.list_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.list_frame.pack(fill="x")
        self._count = -1
        self.rebuild()
        self.cfg.reload_listeners.append(self.rebuild)

    def prompts(self) -> list:
        return self.cfg.data["sampling"].setdefault("prompts", [])

    def add(self, prompt: str = "") -> None:
        self.prompts().append(SamplePromptConfig(prompt=prompt).model_dump(mode="json"))
        self.rebuild(force=True)
        self.cfg.validate()

    def remove(self, index: int) -> None:
        del self.prompts()[index]
        self.rebuild(force=True)
        self.cfg.validate()

    def sample_now(self, index: int) -> bool:
        """This prompt, as it is in the editor now, sampled from the running model at its next step."""
        prompt = self.prompts()[index]
        try:
            prompt = SamplePromptConfig.model_validate(prompt).model_dump(mode="json")
        except ValueError as error:
            self.app.set_status(f"sampling.prompts[{index}]: fix the prompt first ({error.errors()[0]['msg']})")
            return False
        if not self.app.send_command("sample", prompt):
            self.app.set_status("Sample now: start a run first (samples come from the model being trained).")
            return False
        self.app.set_status(f"Sampling prompt {index + 1} at the next step; it appears in the Run tab's gallery.")
        return True

    def rebuild(self, force: bool = False) -> None:
        count = len(self.prompts())
        if count == self._count and not force:
            return
        self._count = count
        for child in self.list_frame.winfo_children():
            child.destroy()  # the prompts' own fields release their own bindings
        if not count:
            ctk.CTkLabel(self.list_frame, text="No prompts: nothing is sampled.", anchor="w").pack(fill="x", padx=8)
        for index in range(count):
            at = f"sampling.prompts[{index}]"
            box = ctk.CTkFrame(self.list_frame)
            box.pack(fill="x", padx=8, pady=6)
            head = ctk.CTkFrame(box, fg_color="transparent")
            head.pack(fill="x")
            ctk.CTkLabel(head, text=f"Prompt {index + 1}", font=ctk.CTkFont(weight="bold")).pack(side="left", padx=8)
            ctk.CTkButton(head, text="Remove", width=80, fg_color="#8e3b3b", hover_color="#6e2b2b",
                          command=lambda i=index: self.remove(i)).pack(side="right", padx=8, pady=4)
            ctk.CTkButton(head, text="Sample now", width=100,
                          command=lambda i=index: self.sample_now(i)).pack(side="right", padx=4, pady=4)
            self.form(box, SamplePromptConfig, at)
