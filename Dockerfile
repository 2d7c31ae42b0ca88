# sandbox-broker image. Build with `make image`: the static binary is built
# on the host (no Go image is needed) and the base is the offline
# debian:bookworm-slim made by runners/base/build-base.sh.
FROM debian:bookworm-slim
RUN find / -xdev -perm /6000 -type f -exec chmod a-s {} + \
 && mkdir -p /var/lib/sandbox-broker && chmod 0700 /var/lib/sandbox-broker
# sandbox-agent is the in-sandbox agent built alone: the broker copies it
# into its sandboxes (and pods' init containers copy it from here).
COPY bin/sandbox-broker bin/sandbox-agent /usr/local/bin/
ENV SANDBOX_ROOT=/var/lib/sandbox-broker \
    MCP_HTTP_ADDR=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/sandbox-broker"]
CMD ["serve", "--transport", "http"]
