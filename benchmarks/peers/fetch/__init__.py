"""vLLM's parts for a GPU machine without network: fetch_vllm.sh packs them (fatbin.py strips the
libraries to sm_90, fetch_manifest.py lists them), unpack_vllm.sh unpacks them there (unzstd.py where
the zstd tool is missing)."""
