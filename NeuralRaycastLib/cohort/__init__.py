"""Cohorts: one training run per study of a list, resumable, on this machine or a Ray cluster.

    tasks.py        the task list (a folder of studies, a CSV or JSON of paths, a glob, generated studies)
    study_task.py   one study: train_study into its folder under the cohort's, whole or not at all
    summary.py      the cohort's table (CSV, JSON, HTML with its distributions), rewritten as studies finish
    runner.py       the studies in turn in this process, on this machine's GPUs, or as Ray tasks, sized to the
                    GPU memory budget
    local_gpus.py   this machine's GPUs without Ray: slots that each train a study at a time in a process of its own
    study_process.py  the process that trains one study and prints its record

Ray is optional (``pip install .[cohort]``); nothing here imports it until a Ray address is given.
"""
