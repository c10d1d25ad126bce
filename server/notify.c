/* Service manager notifications (sd_notify): READY, STOPPING, STATUS and watchdog pings. */
#include "server/notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef HAVE_LIBSYSTEMD
#include <systemd/sd-daemon.h>

int md_notify(const char *state)
{
	int rc = sd_notify(0, state);
	return rc < 0 ? rc : 0;
}

uint64_t md_notify_watchdog_usec(void)
{
	uint64_t usec = 0;
	return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}
#else
#include <sys/socket.h>
#include <sys/un.h>

/* The protocol is one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET ('@' = abstract). */
int md_notify(const char *state)
{
	const char *path = getenv("NOTIFY_SOCKET");
	if (!path || !*path)
		return 0;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t len = strlen(path);
	if (len >= sizeof(sa.sun_path) || (path[0] != '/' && path[0] != '@'))
		return -EINVAL;
	memcpy(sa.sun_path, path, len);
	if (path[0] == '@')
		sa.sun_path[0] = 0;
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
	ssize_t n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, sl);
	int rc = n < 0 ? -errno : 0;
	close(fd);
	return rc;
}

uint64_t md_notify_watchdog_usec(void)
{
	const char *s = getenv("WATCHDOG_USEC");
	const char *pid = getenv("WATCHDOG_PID");
	if (!s)
		return 0;
	if (pid && (pid_t)strtol(pid, NULL, 10) != getpid())
		return 0;
	return strtoull(s, NULL, 10);
}
#endif
