/*
 * A fake libnvidia-ml.so.1 for tests: only the NVML entry points tpflex_agent's NVML
 * backend calls (pynvml resolves symbols lazily), answering from a state file.
 *
 * FAKE_NVML_STATE names a text file (written atomically by the test, by rename; re-read
 * whenever its inode, mtime or size changes), one record per line, '#' starts a comment:
 *   gpu <index> key=value ...   keys: uuid name serial power_mw limit_mw default_mw
 *                               min_mw max_mw temp sm_mhz max_sm_mhz throttle ecc_sbe
 *                               ecc_dbe retired remap_pending remap_failed nvlinks
 *                               nvlink_down lost deny_set   ('_' in name = space)
 *                               fabric_uuid (32 hex digits, '-' ignored) fabric_clique
 *                               fabric_state (nvmlGpuFabricState_t; 0 = no fabric: the
 *                               fabric calls answer NOT_SUPPORTED) fabric_status
 *                               fabric_legacy (1: an older driver, the versioned
 *                               nvmlDeviceGetGpuFabricInfoV answers FUNCTION_NOT_FOUND)
 *   event <index> xid <code>    an XID critical error event (delivered once, in order;
 *                               keep earlier events in the file, append new ones)
 *   event <index> dbe           a double-bit ECC error event
 *   init_error <nvml code>      nvmlInitWithFlags fails with that code
 * Limits and locked clocks set through the API live in this process's memory, as they
 * would in the driver. FAKE_NVML_LOG, when set, names a file that gets one line per set
 * call: "<call> <index> <args> rc=<code>", so a test can see which devices were touched.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    OK = 0, E_UNINIT = 1, E_INVAL = 2, E_NOTSUP = 3, E_NOPERM = 4, E_NOTFOUND = 6,
    E_SIZE = 7, E_DRIVER = 9, E_TIMEOUT = 10, E_NOFUNC = 13, E_LOST = 15, E_VERSION = 25, E_UNKNOWN = 999
};
#define EV_DBE 0x2ULL
#define EV_XID 0x8ULL
#define MAX_GPUS 128
#define MAX_EVENTS 4096

typedef struct { int index; } fake_device;

typedef struct {
    char uuid[96], name[96], serial[32];
    unsigned power_mw, limit_mw, default_mw, min_mw, max_mw, temp, sm_mhz, max_sm_mhz;
    unsigned long long throttle, ecc_sbe, ecc_dbe;
    unsigned retired, remap_pending, remap_failed, nvlinks, nvlink_down, lost, deny_set;
    unsigned char fabric_uuid[16];
    unsigned fabric_clique, fabric_state, fabric_status, fabric_legacy;
} gpu_state;

/* pynvml's c_nvmlGpuFabricInfo_t and c_nvmlGpuFabricInfo_v2_t */
typedef struct {
    unsigned char clusterUuid[16];
    int status;
    unsigned cliqueId, state;
} fabric_info_v1;
typedef struct {
    unsigned version;
    unsigned char clusterUuid[16];
    int status;
    unsigned cliqueId, state, healthMask;
} fabric_info_v2;
#define FABRIC_INFO_V2 (sizeof(fabric_info_v2) | (2u << 24))

typedef struct { int index; unsigned long long type, data; } fake_event;

typedef struct { unsigned long long mask[MAX_GPUS]; } fake_event_set;

typedef struct {  /* pynvml's c_nvmlEventData_t */
    fake_device *device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} event_data;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static fake_device handles[MAX_GPUS];
static gpu_state gpus[MAX_GPUS];
static unsigned n_gpus;
static fake_event events[MAX_EVENTS];
static unsigned n_events, delivered;
static int init_error, initialized;
static unsigned applied_limit[MAX_GPUS], locked_mhz[MAX_GPUS];
static struct timespec seen_mtime;
static off_t seen_size = -1;
static ino_t seen_ino;

static void set_fabric_uuid(gpu_state *g, const char *v) {
    memset(g->fabric_uuid, 0, sizeof g->fabric_uuid);
    unsigned n = 0;
    for (const char *p = v; *p && n < 32; p++) {
        int d = (*p >= '0' && *p <= '9') ? *p - '0' : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
              : (*p >= 'A' && *p <= 'F') ? *p - 'A' + 10 : -1;
        if (d < 0) continue;  /* dashes */
        g->fabric_uuid[n / 2] |= (unsigned char)(n % 2 ? d : d << 4);
        n++;
    }
}

static void set_field(gpu_state *g, const char *k, const char *v) {
    unsigned long long n = strtoull(v, NULL, 0);
    if (!strcmp(k, "uuid")) snprintf(g->uuid, sizeof g->uuid, "%s", v);
    else if (!strcmp(k, "fabric_uuid")) set_fabric_uuid(g, v);
    else if (!strcmp(k, "name")) {
        snprintf(g->name, sizeof g->name, "%s", v);
        for (char *p = g->name; *p; p++) if (*p == '_') *p = ' ';
    }
    else if (!strcmp(k, "serial")) snprintf(g->serial, sizeof g->serial, "%s", v);
#define U(f) else if (!strcmp(k, #f)) g->f = n;
    U(power_mw) U(limit_mw) U(default_mw) U(min_mw) U(max_mw) U(temp) U(sm_mhz)
    U(max_sm_mhz) U(throttle) U(ecc_sbe) U(ecc_dbe) U(retired) U(remap_pending)
    U(remap_failed) U(nvlinks) U(nvlink_down) U(lost) U(deny_set) U(fabric_clique)
    U(fabric_state) U(fabric_status) U(fabric_legacy)
#undef U
}

static void parse_line(char *line) {
    char *save = NULL, *tok = strtok_r(line, " \t\r", &save);
    if (!tok || tok[0] == '#') return;
    if (!strcmp(tok, "init_error")) {
        char *v = strtok_r(NULL, " \t\r", &save);
        init_error = v ? atoi(v) : 0;
        return;
    }
    char *idx = strtok_r(NULL, " \t\r", &save);
    if (!idx) return;
    int i = atoi(idx);
    if (i < 0 || i >= MAX_GPUS) return;
    if (!strcmp(tok, "gpu")) {
        if ((unsigned)i + 1 > n_gpus) n_gpus = i + 1;
        for (char *kv; (kv = strtok_r(NULL, " \t\r", &save));) {
            char *eq = strchr(kv, '=');
            if (eq) { *eq = 0; set_field(&gpus[i], kv, eq + 1); }
        }
    } else if (!strcmp(tok, "event") && n_events < MAX_EVENTS) {
        char *kind = strtok_r(NULL, " \t\r", &save), *code = strtok_r(NULL, " \t\r", &save);
        if (!kind) return;
        fake_event *e = &events[n_events++];
        e->index = i;
        e->type = strcmp(kind, "dbe") ? EV_XID : EV_DBE;
        e->data = code ? strtoull(code, NULL, 0) : (e->type == EV_DBE ? 48 : 0);
    }
}

/* Re-read the state file if it changed. Called with mu held. */
static void reload(void) {
    const char *path = getenv("FAKE_NVML_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) return;
    if (st.st_size == seen_size && st.st_ino == seen_ino && st.st_mtim.tv_sec == seen_mtime.tv_sec
        && st.st_mtim.tv_nsec == seen_mtime.tv_nsec) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *buf = malloc(st.st_size + 1);
    size_t len = buf ? fread(buf, 1, st.st_size, f) : 0;
    fclose(f);
    if (!buf) return;
    buf[len] = 0;
    memset(gpus, 0, sizeof gpus);
    n_gpus = 0; n_events = 0; init_error = 0;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
        parse_line(line);
    free(buf);
    seen_size = st.st_size;
    seen_ino = st.st_ino;
    seen_mtime = st.st_mtim;
}

static void log_call(const char *call, int index, unsigned a, unsigned b, nvmlReturn_t rc) {
    const char *path = getenv("FAKE_NVML_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s %d %u %u rc=%d\n", call, index, a, b, rc);
    fclose(f);
}

/* Resolve a handle to its GPU with mu held; fails for unknown or lost GPUs. */
static nvmlReturn_t gpu_of(fake_device *d, gpu_state **out) {
    if (!initialized) return E_UNINIT;
    reload();
    if (!d || d < handles || d >= handles + MAX_GPUS) return E_INVAL;
    if ((unsigned)d->index >= n_gpus) return E_NOTFOUND;
    if (gpus[d->index].lost) return E_LOST;
    *out = &gpus[d->index];
    return OK;
}

static unsigned limit_of(int i) { return applied_limit[i] ? applied_limit[i] : gpus[i].limit_mw; }

#define WITH_GPU(dev) \
    gpu_state *g = NULL; pthread_mutex_lock(&mu); \
    nvmlReturn_t rc = gpu_of((fake_device *)(dev), &g); \
    if (rc != OK) { pthread_mutex_unlock(&mu); return rc; } \
    int idx = ((fake_device *)(dev))->index; (void)idx;
#define DONE(r) do { pthread_mutex_unlock(&mu); return (r); } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    if (!getenv("FAKE_NVML_STATE")) return E_DRIVER;
    pthread_mutex_lock(&mu);
    /* a fresh "driver": forget limits, clocks and delivered events of an earlier init */
    memset(applied_limit, 0, sizeof applied_limit);
    memset(locked_mhz, 0, sizeof locked_mhz);
    delivered = 0;
    seen_size = -1;
    reload();
    nvmlReturn_t rc = init_error ? init_error : OK;
    if (rc == OK) {
        initialized = 1;
        for (int i = 0; i < MAX_GPUS; i++) handles[i].index = i;
    }
    DONE(rc);
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    initialized = 0;
    DONE(OK);
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case OK: return "Success";
    case E_UNINIT: return "Uninitialized";
    case E_INVAL: return "Invalid Argument";
    case E_NOTSUP: return "Not Supported";
    case E_NOPERM: return "Insufficient Permissions";
    case E_NOTFOUND: return "Not Found";
    case E_DRIVER: return "Driver Not Loaded";
    case E_TIMEOUT: return "Timeout";
    case E_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned len) {
    snprintf(buf, len, "fake-nvml-1.0");
    return OK;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    pthread_mutex_lock(&mu);
    if (!initialized) DONE(E_UNINIT);
    reload();
    *count = n_gpus;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, fake_device **dev) {
    pthread_mutex_lock(&mu);
    if (!initialized) DONE(E_UNINIT);
    reload();
    if (index >= n_gpus) DONE(E_INVAL);
    *dev = &handles[index];
    DONE(OK);
}

static nvmlReturn_t copy_str(char *dst, unsigned len, const char *src) {
    if (strlen(src) + 1 > len) return E_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return OK;
}
nvmlReturn_t nvmlDeviceGetUUID(void *d, char *buf, unsigned len) { WITH_GPU(d); DONE(copy_str(buf, len, g->uuid)); }
nvmlReturn_t nvmlDeviceGetName(void *d, char *buf, unsigned len) { WITH_GPU(d); DONE(copy_str(buf, len, g->name)); }
nvmlReturn_t nvmlDeviceGetSerial(void *d, char *buf, unsigned len) { WITH_GPU(d); DONE(copy_str(buf, len, g->serial)); }

nvmlReturn_t nvmlDeviceGetPowerUsage(void *d, unsigned *mw) {
    WITH_GPU(d);
    unsigned lim = limit_of(idx);
    *mw = g->power_mw < lim ? g->power_mw : lim;
    DONE(OK);
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(void *d, unsigned *mw) { WITH_GPU(d); *mw = limit_of(idx); DONE(OK); }
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *d, unsigned *mw) { WITH_GPU(d); *mw = limit_of(idx); DONE(OK); }
nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(void *d, unsigned *mw) { WITH_GPU(d); *mw = g->default_mw; DONE(OK); }
nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(void *d, unsigned *lo, unsigned *hi) {
    WITH_GPU(d);
    *lo = g->min_mw; *hi = g->max_mw;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(void *d, unsigned mw) {
    WITH_GPU(d);
    rc = g->deny_set ? E_NOPERM : (mw < g->min_mw || mw > g->max_mw) ? E_INVAL : OK;
    if (rc == OK) applied_limit[idx] = mw;
    log_call("set_power_limit", idx, mw, 0, rc);
    DONE(rc);
}

nvmlReturn_t nvmlDeviceSetGpuLockedClocks(void *d, unsigned lo, unsigned hi) {
    WITH_GPU(d);
    rc = g->deny_set ? E_NOPERM : (lo > hi || hi > g->max_sm_mhz) ? E_INVAL : OK;
    if (rc == OK) locked_mhz[idx] = hi;
    log_call("set_locked_clocks", idx, lo, hi, rc);
    DONE(rc);
}

nvmlReturn_t nvmlDeviceResetGpuLockedClocks(void *d) {
    WITH_GPU(d);
    rc = g->deny_set ? E_NOPERM : OK;
    if (rc == OK) locked_mhz[idx] = 0;
    log_call("reset_locked_clocks", idx, 0, 0, rc);
    DONE(rc);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(void *d, unsigned long long *r) { WITH_GPU(d); *r = g->throttle; DONE(OK); }
nvmlReturn_t nvmlDeviceGetTemperature(void *d, int sensor, unsigned *t) {
    WITH_GPU(d);
    if (sensor != 0) DONE(E_NOTSUP);
    *t = g->temp;
    DONE(OK);
}
nvmlReturn_t nvmlDeviceGetClockInfo(void *d, int type, unsigned *mhz) {
    WITH_GPU(d);
    (void)type;
    *mhz = (locked_mhz[idx] && locked_mhz[idx] < g->sm_mhz) ? locked_mhz[idx] : g->sm_mhz;
    DONE(OK);
}
nvmlReturn_t nvmlDeviceGetMaxClockInfo(void *d, int type, unsigned *mhz) { WITH_GPU(d); (void)type; *mhz = g->max_sm_mhz; DONE(OK); }

nvmlReturn_t nvmlDeviceGetTotalEccErrors(void *d, int err_type, int counter, unsigned long long *n) {
    WITH_GPU(d);
    (void)counter;
    *n = err_type == 1 ? g->ecc_dbe : g->ecc_sbe;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(void *d, unsigned *corr, unsigned *unc, unsigned *pending, unsigned *failed) {
    WITH_GPU(d);
    *corr = 0; *unc = 0; *pending = g->remap_pending; *failed = g->remap_failed;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceGetRetiredPages(void *d, int cause, unsigned *count, unsigned long long *addrs) {
    WITH_GPU(d);
    unsigned n = cause == 1 ? g->retired : 0;
    if (!addrs || *count < n) { *count = n; DONE(n ? E_SIZE : OK); }
    for (unsigned i = 0; i < n; i++) addrs[i] = 0x1000ULL * (i + 1);
    *count = n;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(void *d, unsigned link, unsigned *active) {
    WITH_GPU(d);
    if (g->nvlinks == 0) DONE(E_NOTSUP);
    if (link >= g->nvlinks) DONE(E_INVAL);
    *active = link >= g->nvlink_down;
    DONE(OK);
}

/* NVLink fabric (GB200 NVL72); a GPU with fabric_state 0 has none: NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceGetGpuFabricInfo(void *d, fabric_info_v1 *info) {
    WITH_GPU(d);
    if (!info) DONE(E_INVAL);
    if (g->fabric_state == 0) DONE(E_NOTSUP);
    memcpy(info->clusterUuid, g->fabric_uuid, 16);
    info->status = (int)g->fabric_status;
    info->cliqueId = g->fabric_clique;
    info->state = g->fabric_state;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(void *d, fabric_info_v2 *info) {
    WITH_GPU(d);
    if (!info) DONE(E_INVAL);
    if (g->fabric_legacy) DONE(E_NOFUNC);
    if (info->version != FABRIC_INFO_V2) DONE(E_VERSION);
    if (g->fabric_state == 0) DONE(E_NOTSUP);
    memcpy(info->clusterUuid, g->fabric_uuid, 16);
    info->status = (int)g->fabric_status;
    info->cliqueId = g->fabric_clique;
    info->state = g->fabric_state;
    info->healthMask = 0;
    DONE(OK);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(void *d, unsigned long long *types) { WITH_GPU(d); *types = EV_XID | EV_DBE; DONE(OK); }

nvmlReturn_t nvmlEventSetCreate(fake_event_set **set) {
    *set = calloc(1, sizeof **set);
    return *set ? OK : E_UNKNOWN;
}
nvmlReturn_t nvmlEventSetFree(fake_event_set *set) { free(set); return OK; }

nvmlReturn_t nvmlDeviceRegisterEvents(void *d, unsigned long long types, fake_event_set *set) {
    WITH_GPU(d);
    if (!set) DONE(E_INVAL);
    if (types & ~(EV_XID | EV_DBE)) DONE(E_NOTSUP);
    set->mask[idx] |= types;
    DONE(OK);
}

/* Deliver the next undelivered event this set registered for, polling the file. */
nvmlReturn_t nvmlEventSetWait_v2(fake_event_set *set, event_data *out, unsigned timeout_ms) {
    struct timespec start, now, nap = {0, 2 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&mu);
        if (!initialized) DONE(E_UNINIT);
        reload();
        while (delivered < n_events) {
            fake_event *e = &events[delivered++];
            if (set->mask[e->index] & e->type) {
                memset(out, 0, sizeof *out);
                out->device = &handles[e->index];
                out->eventType = e->type;
                out->eventData = e->data;
                DONE(OK);
            }
        }
        pthread_mutex_unlock(&mu);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long waited = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited >= (long)timeout_ms) return E_TIMEOUT;
        nanosleep(&nap, NULL);
    }
}
