"""The worker side of a job: the loop that takes batches and computes them
(:mod:`service.worker.loop`), the events it emits once per batch or job
(:mod:`service.worker.events`), and their two subscribers: the Prometheus series
(:mod:`service.worker.series`) and the status page's recorder (:mod:`service.worker.recorder`).
"""
