package main

import (
	"context"
	"os"
	"time"

	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/tsdb"
)

// store is a TSDB in a temporary directory and an engine over it.
type store struct {
	dir    string
	db     *tsdb.DB
	engine *promql.Engine
}

func openStore() (*store, error) {
	dir, err := os.MkdirTemp("", "monitoring-tsdb-")
	if err != nil {
		return nil, err
	}
	opts := tsdb.DefaultOptions()
	// Samples from time 0 on, as promtool's unit tests write them.
	opts.OutOfOrderTimeWindow = time.Hour.Milliseconds() * 24 * 365 * 100
	db, err := tsdb.Open(dir, nil, nil, opts, nil)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	engine := promql.NewEngine(promql.EngineOpts{
		MaxSamples:    10_000_000,
		Timeout:       time.Minute,
		LookbackDelta: 5 * time.Minute,
		Parser:        parser.NewParser(parser.Options{}),
	})
	return &store{dir: dir, db: db, engine: engine}, nil
}

func (s *store) close() {
	s.engine.Close()
	s.db.Close()
	os.RemoveAll(s.dir)
}

// query evaluates expr at t.
func (s *store) query(expr string, t time.Time) (promql.Vector, error) {
	q, err := s.engine.NewInstantQuery(context.Background(), s.db, nil, expr, t)
	if err != nil {
		return nil, err
	}
	defer q.Close()
	res := q.Exec(context.Background())
	if res.Err != nil {
		return nil, res.Err
	}
	switch v := res.Value.(type) {
	case promql.Vector:
		return v, nil
	case promql.Scalar:
		return promql.Vector{{T: v.T, F: v.V}}, nil
	default:
		return nil, nil
	}
}
