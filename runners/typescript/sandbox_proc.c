/*
 * sandbox_proc.node: the two process calls Node lacks, for the
 * sandbox-broker agent's Node resident and spares (services/agent
 * node_resident.js, node_run.js):
 *
 *   setsid()            -> the new session ID; throws on failure
 *   setDumpable(bool)   -> prctl(PR_SET_DUMPABLE); throws on failure
 *
 * A spare waits in the agent's session and must leave it before it runs
 * a run's code; a resident must not be traceable by code of the same uid.
 * Built against Node-API (stable across Node versions) in the typescript
 * runner's discarded build stage.
 */
#define NAPI_VERSION 3
#include <errno.h>
#include <node_api.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static napi_value fail(napi_env env, const char *what) {
  char msg[128];
  snprintf(msg, sizeof msg, "%s: %s", what, strerror(errno));
  napi_throw_error(env, NULL, msg);
  return NULL;
}

static napi_value do_setsid(napi_env env, napi_callback_info info) {
  (void)info;
  pid_t sid = setsid();
  if (sid < 0) {
    return fail(env, "setsid");
  }
  napi_value out;
  if (napi_create_int32(env, (int32_t)sid, &out) != napi_ok) {
    return NULL;
  }
  return out;
}

static napi_value do_set_dumpable(napi_env env, napi_callback_info info) {
  size_t argc = 1;
  napi_value argv[1];
  bool on = false;
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok || argc != 1 ||
      napi_get_value_bool(env, argv[0], &on) != napi_ok) {
    napi_throw_type_error(env, NULL, "setDumpable(bool)");
    return NULL;
  }
  if (prctl(PR_SET_DUMPABLE, on ? 1 : 0, 0, 0, 0) != 0) {
    return fail(env, "prctl(PR_SET_DUMPABLE)");
  }
  return NULL;
}

NAPI_MODULE_INIT() {
  napi_property_descriptor props[] = {
      {"setsid", NULL, do_setsid, NULL, NULL, NULL, napi_enumerable, NULL},
      {"setDumpable", NULL, do_set_dumpable, NULL, NULL, NULL, napi_enumerable, NULL},
  };
  if (napi_define_properties(env, exports, sizeof props / sizeof props[0], props) != napi_ok) {
    return NULL;
  }
  return exports;
}
