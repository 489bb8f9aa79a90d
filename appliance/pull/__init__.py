"""`appliance pull REPO[:REVISION]`: a model from a Hugging Face-compatible hub, made ready to serve; `appliance rm`.

What is pulled: a repository that holds an OpenVINO IR (openvino_model.xml/.bin, config.json, tokenizer.json, as
OpenVINO's own `OpenVINO/*-int4-ov` repositories do) is used as published: its files are downloaded, checked and
described by a manifest (export/ir.py), with neither torch nor transformers. A repository of safetensors weights is
exported with the project's exporter (export/exporter.py, the served weight format of this CPU unless
--weight-format says otherwise) where the export tools are installed; without them the pull stops before
downloading anything, saying what to install.

How, so that a partial download is never served:
- one pull of a repository and revision at a time: a lock file (flock) under the staging folder, held by the
  process that pulls; a second pull waits for it (and then finds the model there). The kernel drops the lock of a
  process that dies.
- free disk space is checked against the sizes the hub reports before anything downloads, and each file is held to
  its reported size while it downloads (past it the pull stops and the part is deleted: hub.py fetch_file);
- files download with huggingface_hub into a staging folder (`.staging/` beside the models), which resumes a file
  from its `.incomplete` part: a dropped connection is retried here (RETRIES, each resuming where it stopped), and a
  pull interrupted by anything (a killed process, a vanished client) resumes at the next pull;
- every file is checked against the hub's checksum (the SHA-256 of an LFS file, the git blob id of the others; a
  mismatch deletes the file and fails the pull, so the next one downloads it again);
- the model folder is built beside the download (the weights hard-linked), validated (the IR read and rewritten for
  paged attention, as the runtime will), the manifest written last, and renamed into place in one step
  (appliance/paths.py `pulled_model_dir`); only then is the download deleted.

Where it runs: in its own process, always. `appliance pull` runs it in the CLI's; `/api/pull` in a child process of
the HTTP worker (`python -m appliance.pull --json NAME`, Ollama's status lines on stdout) which the worker relays,
then asks the engine process to serve the model (appliance/server/pulled_models.py). Not in the engine process (a
download or an export would share its GIL and memory with generation, and an export's torch must never enter the
serving processes) and not in the worker itself (which never imports OpenVINO: the IR is validated with it). A
vanished client kills the child: the lock goes with it, the staged files stay for the next pull, nothing half-made
is in the models folder. `appliance rm` and /api/delete remove what an unfinished pull of a name left (store.py
`remove`).

Cost, measured on a loaded 2-core box over loopback (tests/pull/test_pull.py's stand-in hub): the default model's
int4 IR (100 MB) pulls in 7.5-9.5 s, of which the SHA-256 of the weights is 0.5 s and reading and checking the IR 1.4 s.

Nothing here downloads unless asked: huggingface_hub is imported only by a pull, with its telemetry off; the hub
is `HF_ENDPOINT` (default https://huggingface.co), the token `HF_TOKEN` (or huggingface_hub's stored login).

The modules: hub.py (the hub's side: what a revision holds, the downloads, the checksums), store.py (the staging
folder, its locks, the build, the install and `remove`; `pull` runs the steps), command.py (`appliance pull` /
`appliance rm`, their progress, and the /api/pull child's end with its worker), __main__.py (`python -m
appliance.pull`). Each imports only the ones before it.
"""
