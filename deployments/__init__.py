"""The composition root: the whole config (`config`), the Serve application (`app`), the
`poolserve` command (`cli`, with `calibrate_cli`, `batch_cli`, `k8s`), the batch job
(`batch_job`), the admin API client (`admin_client`) and the config reference (`config_doc`)."""
