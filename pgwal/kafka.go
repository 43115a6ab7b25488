package pgwal

import (
	"context"
	"fmt"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/startstop"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// OwnedPublisherStopTimeout bounds the stop of a publisher the reader
// owns (NewKafka, NewKafkaTransactional), once Run has stopped reading.
const OwnedPublisherStopTimeout = relay.ShutdownTimeoutDefault

// NewKafka returns a reader of the outbox of plugin on db that publishes
// to Kafka through a publisher.Kafka built from kcfg, and owns it: Run
// starts the publisher before it reads and returns its error at once when
// no broker answers; the publisher is stopped, bounded by
// OwnedPublisherStopTimeout, once the reader has stopped reading, before
// Stopped is closed. Everything else is New's. The whole wiring, from
// gorm.Open:
//
//	db, err := gorm.Open(postgres.Open(dsn), &gorm.Config{})
//	if err != nil { return err }
//	p, err := outbox.NewPlugin(outbox.Config{Mode: outbox.ModeWAL, Rules: rules})
//	if err != nil { return err }
//	if err := db.Use(p); err != nil { return err }
//	if err := p.AutoMigrate(ctx, db); err != nil { return err }
//	r, err := pgwal.NewKafka(db, p, publisher.KafkaConfig{Brokers: brokers}, pgwal.Config{ReplicationDSN: dsn})
//	if err != nil { return err }
//	if err := r.EnsureSlot(ctx); err != nil { return err }
//	return r.Run(ctx)
//
// kcfg.Logger defaults to cfg.Logger. An invalid kcfg is refused with
// the *relay.ConfigError of publisher.NewKafka. Run a reader made here
// once: its publisher is stopped when Run returns. To share or wrap a
// publisher, build it yourself, start and stop it, and use New.
func NewKafka(db *gorm.DB, plugin *outbox.Plugin, kcfg publisher.KafkaConfig, cfg Config) (*Reader, error) {
	if kcfg.Logger == nil {
		kcfg.Logger = cfg.Logger
	}
	k, err := publisher.NewKafka(kcfg)
	if err != nil {
		return nil, err
	}
	return owning(New(db, plugin, k, cfg))
}

// NewKafkaTransactional is NewKafka with the strict-mode publisher,
// publisher.Transactional built from tcfg (Kafka transactions, one
// transactional id per bucket; the reader announces its buckets under its
// lease term, see relay.LeaseAware), owned by the reader the same way.
func NewKafkaTransactional(db *gorm.DB, plugin *outbox.Plugin, tcfg publisher.TransactionalConfig, cfg Config) (*Reader, error) {
	if tcfg.Logger == nil {
		tcfg.Logger = cfg.Logger
	}
	t, err := publisher.NewTransactional(tcfg)
	if err != nil {
		return nil, err
	}
	return owning(New(db, plugin, t, cfg))
}

// owning hands the reader's publisher to the reader.
func owning(r *Reader, err error) (*Reader, error) {
	if err != nil {
		return nil, err
	}
	r.owned = r.pub.(relay.PublisherService)
	return r, nil
}

// Publisher returns the publisher the reader publishes through.
func (r *Reader) Publisher() relay.Publisher { return r.pub }

// releaseAfterStop gives up the lease held under term when ctx ended
// Run, once the owned publisher closed (closed): the next reader may
// then take the slot over at once instead of after LeaseDuration. The
// term confirmed what was acknowledged before it ended (confirmLast);
// the messages that were in flight are published again by the next
// reader, as after a takeover, and none can be delivered after its own,
// since the closed publisher holds none in flight.
func (r *Reader) releaseAfterStop(ctx context.Context, term int64, closed bool) {
	if term == 0 || !closed {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.StandbyInterval)
	defer cancel()
	if err := r.leases.release(rctx, term); err != nil {
		r.log.Warn("pgwal: releasing the lease at stop failed; another reader takes over once it lapses", "err", err)
		return
	}
	r.log.Debug("pgwal: released the lease at stop", "term", term)
}

// startOwned starts the publisher the reader owns, if any, bounded by
// ctx; its life is not ctx's: the returned stop stops it, bounded by
// OwnedPublisherStopTimeout, after the reader's last publish, and
// reports whether it closed: nothing it was given is in flight any more.
// Without an owned publisher stop reports false: the caller's publisher
// may still deliver what it was given.
func (r *Reader) startOwned(ctx context.Context) (stop func() (closed bool), err error) {
	if r.owned == nil {
		return func() bool { return false }, nil
	}
	end, err := startstop.StartOwned(ctx, r.owned.Start)
	if err != nil {
		return nil, fmt.Errorf("pgwal: start the publisher: %w", err)
	}
	return func() bool {
		sctx, scancel := context.WithTimeout(context.Background(), OwnedPublisherStopTimeout)
		defer scancel()
		err := r.owned.Stop(sctx)
		if err != nil {
			r.log.Warn("pgwal: the publisher did not stop cleanly", "err", err)
		}
		end()
		return err == nil
	}, nil
}
