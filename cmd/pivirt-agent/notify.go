package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"
)

// notifier tells systemd (Type=notify, $NOTIFY_SOCKET) how the agent is
// doing: READY=1 once it serves, RELOADING=1 and READY=1 around a reload,
// STOPPING=1 on shutdown, and WATCHDOG=1 at half the interval systemd asks
// for (WatchdogSec=). Without $NOTIFY_SOCKET every call does nothing.
type notifier struct {
	logger *slog.Logger
}

func (n notifier) send(state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		n.logger.Warn("systemd notification failed", "state", state, "error", err)
	}
}

// ready: the agent serves.
func (n notifier) ready(status string) {
	n.send(daemon.SdNotifyReady + "\nSTATUS=" + status)
}

// reloading: a reload begins (MONOTONIC_USEC, as Type=notify-reload wants).
func (n notifier) reloading() {
	var ts unix.Timespec
	usec := int64(0)
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err == nil {
		usec = ts.Sec*1_000_000 + ts.Nsec/1000
	}
	n.send(fmt.Sprintf("%s\nMONOTONIC_USEC=%d", daemon.SdNotifyReloading, usec))
}

// stopping: shutdown begins.
func (n notifier) stopping() { n.send(daemon.SdNotifyStopping) }

// watchdog pings systemd at half its watchdog interval while alive
// reports true, until ctx ends. Without WatchdogSec= it returns at once.
func (n notifier) watchdog(ctx context.Context, alive func() bool) {
	interval, err := daemon.SdWatchdogEnabled(false)
	if err != nil || interval <= 0 {
		return
	}
	t := time.NewTicker(interval / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if alive() {
			n.send(daemon.SdNotifyWatchdog)
		} else {
			n.logger.Error("not pinging the systemd watchdog: the agent is not answering")
		}
	}
}
